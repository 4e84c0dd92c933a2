"""Data-parallel training equals one process (issue 9 section 5): the loss is normalised by the
global number of target tokens, so two processes with uneven response lengths (2 and 32 tokens)
reach the weights of one process on the same two examples. torchrun, gloo, CPU."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="needs torchrun")
def test_two_processes_equal_one_process_with_uneven_lengths(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(WORKER), str(one), str(tmp_path / "run1")], check=True, env=_env(),
                   timeout=300)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    res = subprocess.run(torchrun + [str(WORKER), str(two), str(tmp_path / "run2")], env=_env(), timeout=300,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    runs_one, runs_two = torch.load(one), torch.load(two)
    for prompt_grad in (True, False):
        a, b = runs_one[prompt_grad], runs_two[prompt_grad]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=f"prompt_grad={prompt_grad} {k}")


def test_a_launch_accelerate_does_not_see_is_refused(tmp_path, monkeypatch):
    """WORLD_SIZE=2 but a non-distributed Accelerate state: the processes would train
    independently (and overwrite each other's checkpoints); refuse instead."""
    from test_train import cfg, examples, tiny_skipmodel

    from skipdecode.train import train

    from accelerate import PartialState

    PartialState()  # fixed before the launch variables are seen, as an early call in a script would
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", max_steps=1))
