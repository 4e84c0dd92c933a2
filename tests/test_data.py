"""Tests for skipdecode.data. Everything runs on tmp files; the real-data checks skip without it."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from skipdecode.data import hub
from skipdecode.data import (
    DataError,
    EvalItem,
    Example,
    ReadResult,
    TEMPLATES,
    default_data_dir,
    format_prompt,
    load_eval_items,
    load_examples,
    median_response_tokens,
    read_cnndm,
    read_e2e_eval,
    read_e2e_pairs,
    read_jsonl_eval,
    read_jsonl_pairs,
    shared_data_path,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8", newline="")
    return path


def write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    return write(path, "\n".join(lines) + "\n")


E2E_CSV = (
    "mr,ref\n"
    '"name[Alimentum], area[city centre]","Alimentum is in the city centre."\n'
    '"name[Alimentum], area[city centre]","In the centre, there is Alimentum."\n'
    '"name[Blue Spice], priceRange[£20-25]","Blue Spice costs £20-25."\n'
    '"name[Alimentum], area[city centre]","Alimentum: city centre."\n'
)


# ---------------------------------------------------------------- templates


def test_templates_and_format_prompt():
    assert TEMPLATES["e2e"] == "Describe the restaurant in one sentence.\n{mr}\nDescription:"
    assert format_prompt("e2e", mr="name[X]") == (
        "Describe the restaurant in one sentence.\nname[X]\nDescription:")
    assert format_prompt("cnndm", article="A.") == (
        "Summarize the article in three sentences.\nA.\nSummary:")
    assert format_prompt("plain", prompt="hi {there}") == "hi {there}"
    assert format_prompt("plain", prompt="p", extra="ignored") == "p"
    with pytest.raises(ValueError, match="unknown task 'nope'.*e2e"):
        format_prompt("nope", prompt="x")
    with pytest.raises(ValueError, match="mr"):
        format_prompt("e2e", prompt="x")


# ---------------------------------------------------------------- E2E CSV


def test_e2e_pairs(tmp_path):
    ex = read_e2e_pairs(write(tmp_path / "d.csv", E2E_CSV))
    assert isinstance(ex, ReadResult) and isinstance(ex, list)
    assert ex.n_skipped == 0
    assert len(ex) == 4
    assert ex[0] == Example(prompt=format_prompt("e2e", mr="name[Alimentum], area[city centre]"),
                            response="Alimentum is in the city centre.")
    assert ex[2].response == "Blue Spice costs £20-25."


def test_e2e_eval_groups_references_in_first_appearance_order(tmp_path):
    items = read_e2e_eval(write(tmp_path / "t.csv", E2E_CSV))
    assert len(items) == 2
    a, b = items
    assert a.source == "name[Alimentum], area[city centre]"
    assert a.prompt == format_prompt("e2e", mr=a.source)
    assert a.references == ("Alimentum is in the city centre.",
                            "In the centre, there is Alimentum.",
                            "Alimentum: city centre.")
    assert b == EvalItem(prompt=format_prompt("e2e", mr="name[Blue Spice], priceRange[£20-25]"),
                         references=("Blue Spice costs £20-25.",),
                         source="name[Blue Spice], priceRange[£20-25]")


def test_e2e_header_case_extra_columns_and_bom(tmp_path):
    text = "\ufeffMR, Ref ,fixed\n\"name[A]\",\"A.\",0\n"
    items = read_e2e_eval(write(tmp_path / "c.csv", text))
    assert items[0].references == ("A.",) and items[0].source == "name[A]"


def test_e2e_eval_without_refs_when_allowed(tmp_path):
    path = write(tmp_path / "testset.csv", 'MR\n"name[A]"\n"name[B]"\n')
    with pytest.raises(DataError, match="'ref'"):
        read_e2e_eval(path)
    items = read_e2e_eval(path, require_refs=False)
    assert [i.source for i in items] == ["name[A]", "name[B]"]
    assert items[0].references == ()


def test_e2e_missing_column_lists_found_and_expected(tmp_path):
    path = write(tmp_path / "bad.csv", "mr,text\nname[A],hello\n")
    with pytest.raises(DataError) as ei:
        read_e2e_pairs(path)
    msg = str(ei.value)
    assert "bad.csv" in msg and "line 1" in msg
    assert "missing column(s) 'ref'" in msg
    assert "found columns: 'mr', 'text'" in msg and "expected columns: 'mr', 'ref'" in msg


def test_e2e_empty_and_header_only_files(tmp_path):
    with pytest.raises(DataError, match=r"empty\.csv: file is empty"):
        read_e2e_pairs(write(tmp_path / "empty.csv", ""))
    with pytest.raises(DataError, match=r"head\.csv: no usable rows"):
        read_e2e_eval(write(tmp_path / "head.csv", "mr,ref\n"))


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.csv"
    for fn in (read_e2e_pairs, read_e2e_eval, read_jsonl_pairs, read_jsonl_eval, read_cnndm):
        with pytest.raises(DataError, match=r"nope\.csv: file does not exist"):
            fn(missing)


def test_e2e_bad_row_reports_record_line_and_skip_counts(tmp_path):
    text = (
        "mr,ref\n"                              # line 1
        '"name[A]","first line\nsecond line"\n'  # lines 2-3 (one record)
        '"name[B]",""\n'                         # line 4: empty ref
        '"name[C]","ok","extra"\n'               # line 5: wrong field count
        "\n"                                     # line 6: blank, ignored
        '"name[D]","fine"\n'                     # line 7
    )
    path = write(tmp_path / "rows.csv", text)
    with pytest.raises(DataError) as ei:
        read_e2e_pairs(path)
    assert str(ei.value).startswith(f"{path}, line 4: empty 'ref'")
    assert ei.value.line == 4

    ex = read_e2e_pairs(path, skip_bad_rows=True)
    assert [e.response for e in ex] == ["first line\nsecond line", "fine"]
    assert ex.n_skipped == 2
    assert "line 4" in ex.skipped[0] and "line 5" in ex.skipped[1]
    assert "expected 2 fields" in ex.skipped[1]

    items = read_e2e_eval(path, skip_bad_rows=True)
    assert len(items) == 2 and items.n_skipped == 2


def test_e2e_unterminated_quote_is_fatal(tmp_path):
    path = write(tmp_path / "q.csv", 'mr,ref\n"name[A]","ok"\n"name[B]","never closed\n')
    with pytest.raises(DataError, match=r"q\.csv, line 3: malformed CSV"):
        read_e2e_pairs(path, skip_bad_rows=True)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "enc.csv"
    path.write_bytes(b"mr,ref\nname[A],ok\nname[B],caf\xe9\n")
    with pytest.raises(DataError, match=r"enc\.csv, line 3: not valid UTF-8"):
        read_e2e_pairs(path)


def test_all_rows_bad_still_raises_when_skipping(tmp_path):
    path = write(tmp_path / "allbad.csv", 'mr,ref\n"",x\n"name[A]",""\n')
    with pytest.raises(DataError, match="no usable rows.*2 bad row"):
        read_e2e_pairs(path, skip_bad_rows=True)


# ---------------------------------------------------------------- JSONL


def test_jsonl_pairs_and_eval(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q1", "response": "A1", "id": 1}, "",
                                            {"prompt": "Q2", "response": "A2"}])
    ex = read_jsonl_pairs(p)
    assert ex == [Example("Q1", "A1"), Example("Q2", "A2")] and ex.n_skipped == 0

    e = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Q1", "references": ["r1", "r2"]},
                                            {"prompt": "Q2", "references": "only"}])
    items = read_jsonl_eval(e)
    assert items[0] == EvalItem("Q1", ("r1", "r2"), "Q1")
    assert items[1].references == ("only",)


def test_jsonl_with_task_template(tmp_path):
    p = write_jsonl(tmp_path / "m.jsonl", [{"mr": "name[A]", "response": "A."}])
    ex = read_jsonl_pairs(p, task="e2e")
    assert ex[0].prompt == format_prompt("e2e", mr="name[A]")
    with pytest.raises(DataError, match="missing key 'prompt'"):
        read_jsonl_pairs(p)


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "Q", "response": ', "invalid JSON"),
        ('["prompt", "response"]', "expected a JSON object, found list"),
        ('{"prompt": "Q"}', "missing key 'response'; found keys: 'prompt'; "
                            "expected keys: 'prompt', 'response'"),
        ('{"prompt": 3, "response": "A"}', "'prompt' must be a string, found int"),
        ('{"prompt": "   ", "response": "A"}', "empty 'prompt'"),
    ],
)
def test_jsonl_pairs_bad_line(tmp_path, bad_line, reason):
    good = json.dumps({"prompt": "Q", "response": "A"})
    path = write(tmp_path / "bad.jsonl", "\n".join([good, "", bad_line, good]) + "\n")
    with pytest.raises(DataError) as ei:
        read_jsonl_pairs(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}, line 3: ")
    assert reason in msg
    ok = read_jsonl_pairs(path, skip_bad_rows=True)
    assert len(ok) == 2 and ok.n_skipped == 1 and "line 3" in ok.skipped[0]


@pytest.mark.parametrize(
    "refs, reason",
    [([], "no non-empty reference"), ([""], "no non-empty reference"),
     (["a", 2], "references[1] must be a string, found int"),
     ({"a": 1}, "must be a string or a list of strings, found dict")],
)
def test_jsonl_eval_bad_references(tmp_path, refs, reason):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "Q", "references": ["ok"]},
                                               {"prompt": "Q", "references": refs}])
    with pytest.raises(DataError) as ei:
        read_jsonl_eval(path)
    assert "r.jsonl, line 2: " in str(ei.value) and reason in str(ei.value)
    assert read_jsonl_eval(path, skip_bad_rows=True).n_skipped == 1


def test_jsonl_empty_file(tmp_path):
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable records"):
        read_jsonl_pairs(write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(DataError, match=r"blank\.jsonl: no usable records"):
        read_jsonl_eval(write(tmp_path / "blank.jsonl", "\n\n  \n"))


def test_cnndm(tmp_path):
    path = write_jsonl(tmp_path / "cnn.jsonl", [
        {"question_id": 241, "article": "The article text.", "highlights": "The summary."},
        {"question_id": 242, "article": "Another.", "summary": "Short."},
    ])
    items = read_cnndm(path)
    assert items[0] == EvalItem(prompt=format_prompt("cnndm", article="The article text."),
                                references=("The summary.",), source="The article text.")
    assert items[1].references == ("Short.",)
    bad = write_jsonl(tmp_path / "cnnbad.jsonl", [{"article": "x"}])
    with pytest.raises(DataError, match=r"cnnbad\.jsonl, line 1: missing summary key"):
        read_cnndm(bad)


# ---------------------------------------------------------------- dispatch


def test_load_dispatch_by_extension(tmp_path):
    csv_path = write(tmp_path / "d.csv", E2E_CSV)
    assert len(load_examples(str(csv_path))) == 4
    assert len(load_eval_items(csv_path)) == 2

    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "response": "A"}])
    assert load_examples(pairs) == [Example("Q", "A")]

    cnn = write_jsonl(tmp_path / "c.jsonl", [{"article": "Art.", "highlights": "Hi."}])
    items = load_eval_items(cnn)
    assert items[0].source == "Art." and items[0].references == ("Hi.",)
    ex = load_examples(cnn)
    assert ex == [Example(format_prompt("cnndm", article="Art."), "Hi.")]

    ev = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Q", "references": ["a", "b"]}])
    assert load_eval_items(ev)[0].references == ("a", "b")

    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load_examples(write(tmp_path / "x.txt", "hi"))


def test_relative_spec_resolved_under_data_dir(tmp_path, monkeypatch):
    (tmp_path / "e2e").mkdir()
    write(tmp_path / "e2e" / "dev.csv", E2E_CSV)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))
    monkeypatch.chdir(tmp_path / "e2e")
    assert len(load_eval_items("e2e/dev.csv")) == 2


def test_missing_spec_without_datasets(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "_datasets_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as ei:
        load_examples("no_such_dataset")
    msg = str(ei.value)
    assert "no_such_dataset" in msg and "does not exist" in msg
    assert "pip install datasets" in msg
    with pytest.raises(DataError, match="pip install datasets"):
        load_eval_items("org/some-dataset")


def test_missing_file_like_spec_never_goes_to_the_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "_datasets_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"no_such_file\.jsonl: file does not exist here") as err:
        load_examples("no_such_file.jsonl")
    assert "Hugging Face" not in str(err.value)


def test_hub_spec_uses_datasets_when_available(monkeypatch, tmp_path):
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return [{"meaning_representation": "name[A]", "human_reference": "A one."},
                {"meaning_representation": "name[A]", "human_reference": "A two."},
                {"meaning_representation": "name[B]", "human_reference": "B."}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(hub, "_datasets_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))
    items = load_eval_items("e2e_nlg")
    assert calls[-1] == ("e2e_nlg", None, "test")
    assert [i.references for i in items] == [("A one.", "A two."), ("B.",)]
    assert items[0].prompt == format_prompt("e2e", mr="name[A]")
    ex = load_examples("e2e_nlg:cfg", split="validation")
    assert calls[-1] == ("e2e_nlg", "cfg", "validation")
    assert len(ex) == 3 and ex[0].response == "A one."


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "anywhere"))
    assert default_data_dir() == tmp_path / "anywhere"

    monkeypatch.delenv("SKIPDECODE_DATA")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert default_data_dir() == (tmp_path / "shared" / "data").resolve()



def test_shared_data_path_returns_a_given_value_unchanged(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "absent"))  # never consulted
    assert shared_data_path("mine/train.jsonl", "e2e/devset.csv") == "mine/train.jsonl"
    assert shared_data_path(tmp_path / "x.csv", "e2e/devset.csv") == str(tmp_path / "x.csv")
    assert shared_data_path("org/hub-dataset", "e2e/devset.csv") == "org/hub-dataset"


def test_shared_data_path_default_lies_under_the_shared_folder(monkeypatch, tmp_path):
    (tmp_path / "e2e").mkdir()
    write(tmp_path / "e2e" / "devset.csv", E2E_CSV)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))
    assert shared_data_path(None, "e2e/devset.csv") == str(tmp_path / "e2e" / "devset.csv")
    assert shared_data_path("", "e2e/devset.csv") == str(tmp_path / "e2e" / "devset.csv")  # "": not given
    assert shared_data_path(None) == str(tmp_path)  # no relative path: the folder itself


def test_shared_data_path_missing_default_names_option_folder_and_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))
    with pytest.raises(DataError) as ei:
        shared_data_path(None, "e2e/testset_w_refs.csv", option="--test-data")
    msg = str(ei.value)
    assert "\n" not in msg and "--test-data" in msg and str(tmp_path) in msg
    assert "e2e/testset_w_refs.csv" in msg and "SKIPDECODE_DATA" in msg
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "absent"))
    with pytest.raises(DataError, match=r"no --data given and the shared data folder .*absent.* does not exist"):
        shared_data_path(None)


def test_shared_data_path_without_any_folder_names_the_option_and_places(monkeypatch, tmp_path):
    from skipdecode.data import folder

    monkeypatch.delenv("SKIPDECODE_DATA", raising=False)
    monkeypatch.setattr(folder, "default_data_dir", lambda: None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as ei:
        shared_data_path(None, "e2e/devset.csv")
    msg = str(ei.value)
    assert "no --data given" in msg and "e2e/devset.csv" in msg and "SKIPDECODE_DATA is not set" in msg
    assert str(tmp_path.parent / "shared" / "data") in msg  # the folder it looked in

# ---------------------------------------------------------------- horizon helper


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "a": 2, "b": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")


def test_median_response_tokens():
    tok = _word_tokenizer()
    exs = [Example("p", "a"), Example("p", "a b c"), Example("p", "a b c d e f g")]
    assert median_response_tokens(exs, tok) == 3
    # even count: median 2.5 rounds half up to 3
    assert median_response_tokens(["a b", "a b c", "a", "a b c d e"], tok) == 3
    with pytest.raises(ValueError, match="examples is empty"):
        median_response_tokens([], tok)


# ---------------------------------------------------------------- real data (skipped without it)

_DATA = default_data_dir()
needs_data = pytest.mark.skipif(
    _DATA is None or not (_DATA / "e2e" / "testset_w_refs.csv").is_file(),
    reason="shared data folder not found (set SKIPDECODE_DATA)")


@needs_data
def test_real_e2e_test_set_has_630_mrs():
    items = read_e2e_eval(_DATA / "e2e" / "testset_w_refs.csv")
    assert len(items) == 630 and items.n_skipped == 0
    assert sum(len(i.references) for i in items) == 4693
    assert len(read_e2e_eval(_DATA / "e2e" / "devset.csv")) == 547
    assert len(read_e2e_pairs(_DATA / "e2e" / "devset.csv")) == 4672


@needs_data
def test_real_cnndm_has_80_articles():
    path = _DATA / "cnn_dailymail" / "cnndm_specbench80.jsonl"
    if not path.is_file():
        pytest.skip("cnndm file not present")
    items = load_eval_items(path)
    assert len(items) == 80 and all(len(i.references) == 1 for i in items)


def test_a_missing_relative_data_file_says_where_it_was_looked_for(monkeypatch, tmp_path):
    """A relative path is read from the current folder, else from the shared data folder: the
    error names both, or says that no shared data folder was found."""
    from skipdecode.data import DataError, load_examples
    from skipdecode.data import folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "shared"))
    with pytest.raises(DataError, match=r"e2e/none\.csv: file does not exist here or in the shared data folder "
                                        r".*shared \(SKIPDECODE_DATA\)"):
        load_examples("e2e/none.csv")
    monkeypatch.setattr(folder, "default_data_dir", lambda: None)
    with pytest.raises(DataError, match=r"no shared data folder was found.*set SKIPDECODE_DATA"):
        load_examples("e2e/none.csv")
    with pytest.raises(DataError, match=r"/abs/none\.csv: file does not exist$"):
        load_examples("/abs/none.csv")


def test_a_single_file_reader_reads_the_path_as_given(monkeypatch, tmp_path):
    """read_e2e_pairs never looks in the shared data folder, so its message does not mention it."""
    from skipdecode.data import DataError, read_e2e_pairs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "shared"))
    with pytest.raises(DataError, match=r"e2e/none\.csv: file does not exist$"):
        read_e2e_pairs("e2e/none.csv")
