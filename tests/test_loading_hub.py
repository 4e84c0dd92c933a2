"""Loading a Hugging Face model id: the local cache first, then one metadata request that decides
at once whether a download can work (no huggingface_hub retries on a machine without the hub)."""

from __future__ import annotations

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from skipdecode import hub_loading, loading
from skipdecode.loading import LoadError


def _hub_error(cls: type) -> Exception:
    """An instance of a huggingface_hub HTTP error without an HTTP response behind it."""
    err = cls.__new__(cls)
    Exception.__init__(err, "404 Client Error")
    return err


@pytest.fixture
def hub(monkeypatch):
    """Records the ``_from_pretrained`` calls (cache-only or not) and the ``model_info`` calls;
    ``state["cached"]`` / ``state["info"]`` set what the cache and the hub do."""
    state = {"cached": False, "info": None, "loads": [], "infos": []}

    def from_pretrained(name, dtype, **kwargs):
        state["loads"].append(kwargs.get("local_files_only", False))
        if kwargs.get("local_files_only") and not state["cached"]:
            raise OSError("not in the cache")
        return "model", "tokenizer"

    def model_info(self, name, timeout=None):
        state["infos"].append((name, timeout))
        if state["info"] is not None:
            raise state["info"]

    monkeypatch.setattr(hub_loading, "_from_pretrained", from_pretrained)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return state


def test_a_cached_model_loads_without_the_network(hub):
    hub["cached"] = True
    assert hub_loading._from_hub("org/model", torch.float32) == ("model", "tokenizer")
    assert hub["loads"] == [True] and hub["infos"] == []


def test_an_unreachable_hub_fails_at_once_without_a_download_attempt(hub):
    hub["info"] = ConnectionError("[Errno -2] Name or service not known")
    with pytest.raises(LoadError, match=r"'org/model'.*not in the Hugging Face cache.*cannot be reached.*Name or service"):
        hub_loading._from_hub("org/model", torch.float32)
    assert hub["loads"] == [True]  # the cache only: from_pretrained's retries never start
    assert hub["infos"] == [("org/model", 10)]


def test_a_model_the_hub_does_not_have_is_named(hub):
    hub["info"] = _hub_error(RepositoryNotFoundError)
    with pytest.raises(LoadError, match=r"'nobody/none'.*the hub has no model of that name.*hf auth login"):
        hub_loading._from_hub("nobody/none", torch.float32)
    assert hub["loads"] == [True]


@pytest.mark.parametrize("info", [None, "gated"])
def test_a_model_on_the_hub_is_downloaded(hub, info):
    hub["info"] = _hub_error(GatedRepoError) if info else None  # gated: the download uses the token
    assert hub_loading._from_hub("org/model", torch.float32) == ("model", "tokenizer")
    assert hub["loads"] == [True, False]


def test_hf_hub_offline_skips_the_request(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LoadError, match="HF_HUB_OFFLINE is set"):
        hub_loading._from_hub("org/model", torch.float32)
    assert hub["infos"] == []


def test_a_failed_download_is_a_load_error(hub, monkeypatch):
    def from_pretrained(name, dtype, **kwargs):
        raise OSError("disk full\nmore detail")

    monkeypatch.setattr(hub_loading, "_from_pretrained", from_pretrained)
    with pytest.raises(LoadError, match=r"the download failed \(disk full\)$"):
        hub_loading._from_hub("org/model", torch.float32)


def test_load_routes_a_model_id_through_the_hub_path(hub):
    hub["info"] = ConnectionError("no network")
    with pytest.raises(LoadError, match="cannot be reached"):
        loading.load("org/model")


def test_an_invalid_model_id_is_named_without_a_hub_request(hub):
    with pytest.raises(LoadError, match=r"'bad name' is neither an existing path nor a valid Hugging Face model id"):
        loading.load("bad name")
    assert hub["loads"] == [] and hub["infos"] == []


def test_an_empty_model_name_is_refused(hub):
    with pytest.raises(LoadError, match="got an empty name"):
        loading.load("  ")
    assert hub["loads"] == []


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(LoadError, match=r"cannot read GGUF file .*fake\.gguf: .*magic"):
        loading.load(fake)
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    with pytest.raises(LoadError, match=r"dir\.gguf is a folder, not a GGUF file"):
        loading.load(folder)


def test_a_truncated_gguf_file_is_a_load_error(tmp_path):
    """The first 2 MB of the embedded GGUF file: the header parses, the tensors do not."""
    head = tmp_path / "cut.gguf"
    with open(loading.embedded_gguf_path(), "rb") as f:
        head.write_bytes(f.read(2 << 20))
    with pytest.raises(LoadError, match=r"cannot read GGUF file .*cut\.gguf: "):
        loading.load(head)
