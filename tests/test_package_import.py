"""The package imports its heavy parts on first use: ``skipdecode --help`` and a Ctrl-C before a
command has loaded anything stay light, while the public API reads as before."""

from __future__ import annotations

import subprocess
import sys

import pytest

import skipdecode

HEAVY = ("torch", "transformers", "numpy")


def _modules_after(code: str) -> set[str]:
    """Top-level modules loaded by a fresh interpreter after running ``code``."""
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, timeout=120, check=True)
    return {name.split(".")[0] for name in done.stdout.splitlines()[-1].split()}  # the help text comes before


@pytest.mark.parametrize("code", ["import skipdecode",
                                  "import skipdecode.cli",
                                  "from skipdecode.cli import main\n"
                                  "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass"])
def test_the_package_and_the_command_line_import_no_heavy_library(code):
    loaded = _modules_after(code)
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_every_public_name_resolves_to_its_submodule_object():
    import importlib

    for name in skipdecode.__all__:
        value = getattr(skipdecode, name)
        module = importlib.import_module(f"skipdecode.{skipdecode._PUBLIC[name]}")
        assert value is getattr(module, name), name
    assert set(skipdecode.__all__) <= set(dir(skipdecode))


def test_generate_stays_the_function_after_its_submodule_is_imported():
    """``import skipdecode.generate`` sets the submodule as the package's attribute (importlib);
    ``skipdecode.generate`` must remain the function, as it was when the package imported it eagerly."""
    code = ("import skipdecode.generate, skipdecode, inspect\n"
            "from skipdecode.generate import generate_step\n"
            "print(inspect.isfunction(skipdecode.generate), skipdecode.generate.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "generate"]


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'no_such_name'"):
        skipdecode.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        from skipdecode import no_such_name  # noqa: F401


def test_ctrl_c_inside_a_command_exits_130_without_a_traceback(monkeypatch, capsys):
    """A Ctrl-C while a command imports torch or loads the model (both happen inside the command
    now) ends quietly with the shell's status for SIGINT, as typer does."""
    from skipdecode import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_model", interrupted)
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hello", "--model", "unused"])
    assert info.value.code == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "KeyboardInterrupt" not in captured.err
