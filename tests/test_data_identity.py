"""The run id covers the data by content : store fingerprints and the tokenizer's
hash, never the path; resume refuses a workdir whose data changed under the same path."""

import shutil

import pytest

from hybrid_lm.experiment import config_record, load_config, run_id
from hybrid_lm.data.prepare import prepare
from hybrid_lm.data.sources import SourceSpec
from hybrid_lm.data.tokenizer import train_bpe
from hybrid_lm.errors import ConfigError
from hybrid_lm.train.rundir import prepare_run_dir

from tests.test_store import write_jsonl


def store(tmp_path, name, seed):
    write_jsonl(tmp_path / f"{name}.jsonl", 40, seed=seed)
    return prepare(SourceSpec(kind="text", paths=(str(tmp_path / f"{name}.jsonl"),)), tmp_path / name,
                   progress=False).path


def cfg(*params):
    return load_config(["quickstart.gin"], list(params))


def test_default_data_keeps_the_published_run_id():
    c = cfg()
    assert run_id(c) == "bc91a0bd964d" and config_record(c)["data_identity"] == {}


def test_store_content_not_path_defines_the_id(tmp_path):
    a, b = store(tmp_path, "a", 1), store(tmp_path, "b", 2)
    ida = run_id(cfg("DataConfig.source='tokens'", f"DataConfig.path='{a}'"))
    idb = run_id(cfg("DataConfig.source='tokens'", f"DataConfig.path='{b}'"))
    assert ida != idb != run_id(cfg())
    shutil.move(str(a), str(tmp_path / "moved"))
    assert run_id(cfg("DataConfig.source='tokens'", f"DataConfig.path='{tmp_path / 'moved'}'")) == ida
    w1 = run_id(cfg(f"DataConfig.mixture=(('{tmp_path / 'moved'}', 1.0), ('{b}', 1.0))"))
    w2 = run_id(cfg(f"DataConfig.mixture=(('{tmp_path / 'moved'}', 2.0), ('{b}', 1.0))"))
    assert w1 != w2


def test_tokenizer_hash_not_path_defines_the_id(tmp_path):
    texts = write_jsonl(tmp_path / "t.jsonl", 60)
    tj = train_bpe(iter(texts), 300, tmp_path / "tok")
    params = ["ModelConfig.vocab_size=384"]
    one = run_id(cfg(*params, f"DataConfig.tokenizer='{tj}'"))
    shutil.copytree(tmp_path / "tok", tmp_path / "tok2")
    assert run_id(cfg(*params, f"DataConfig.tokenizer='{tmp_path / 'tok2' / 'tokenizer.json'}'")) == one
    tj2 = train_bpe(iter(texts), 290, tmp_path / "tok3")
    assert run_id(cfg(*params, f"DataConfig.tokenizer='{tj2}'")) != one


def test_resume_refuses_other_data_under_the_same_path(tmp_path):
    a = store(tmp_path, "a", 1)
    c = cfg("DataConfig.source='tokens'", f"DataConfig.path='{a}'")
    prepare_run_dir(c, tmp_path / "run")
    prepare_run_dir(c, tmp_path / "run")  # same data: fine
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')  # it has trained
    import json
    prov = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert prov["data_identity"]["stores"][0][0] == json.loads((a / "manifest.json").read_text())["fingerprint"]
    shutil.rmtree(a)
    write_jsonl(tmp_path / "other.jsonl", 40, seed=9)
    prepare(SourceSpec(kind="text", paths=(str(tmp_path / "other.jsonl"),)), a, progress=False)
    with pytest.raises(ConfigError, match="differing fields: data.identity"):
        prepare_run_dir(cfg("DataConfig.source='tokens'", f"DataConfig.path='{a}'"), tmp_path / "run")


def test_a_path_with_the_default_source_is_identified_by_what_is_read(tmp_path):
    """DataConfig.path set and DataConfig.source left at 'embedded' reads the store at the path: the identity
    is that store's, so a rerun of the same workdir without the path (the essays) is refused, as for
    source='tokens'. A path holding (or to hold) the essays themselves stays the embedded corpus."""
    import json

    a = store(tmp_path, "a", 1)
    c = cfg(f"DataConfig.path='{a}'")
    fp = json.loads((a / "manifest.json").read_text())["fingerprint"]
    assert config_record(c)["data_identity"]["stores"] == [[fp, 1.0]]
    assert run_id(c) != run_id(cfg())
    prepare_run_dir(c, tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')  # it has trained
    with pytest.raises(ConfigError, match="differing fields: data.identity"):
        prepare_run_dir(cfg(), tmp_path / "run")
    assert run_id(cfg(f"DataConfig.path='{tmp_path / 'essays_here'}'")) == run_id(cfg())  # to be prepared: essays
    from hybrid_lm.data.corpus import ensure_store
    ensure_store("embedded", str(tmp_path / "essays_here"), "byte")
    assert run_id(cfg(f"DataConfig.path='{tmp_path / 'essays_here'}'")) == run_id(cfg())  # prepared: the essays


@pytest.mark.integration
def test_a_sweep_relaunched_on_other_data_refuses_and_keeps_its_manifest(tmp_path):
    """A sweep whose runs now resolve to other data refuses to mark the old runs done and
    leaves sweep.json describing what it launched."""
    from hybrid_lm.scaling.sweep import SweepError, expand, load_spec, write_manifest

    spec = load_spec("configs/sweeps/tiny_cpu.toml")
    a = store(tmp_path, "a", 1)
    root = tmp_path / "sweep"
    plan = expand(spec, root=root, extra_params=["DataConfig.source='tokens'", f"DataConfig.path='{a}'"])
    write_manifest(plan)
    for j in plan.jobs[:2]:
        (root / j.name).mkdir()  # launched
    before = (root / "sweep.json").read_text()
    write_manifest(expand(spec, root=root, extra_params=["DataConfig.source='tokens'",
                                                         f"DataConfig.path='{a}'"]))  # the same: fine
    shutil.rmtree(a)
    write_jsonl(tmp_path / "new.jsonl", 40, seed=5)
    prepare(SourceSpec(kind="text", paths=(str(tmp_path / "new.jsonl"),)), a, progress=False)
    other = expand(spec, root=root, extra_params=["DataConfig.source='tokens'", f"DataConfig.path='{a}'"])
    assert {j.name for j in other.jobs}.isdisjoint(j.name for j in plan.jobs)  # other run ids: not "done"
    with pytest.raises(SweepError, match="no longer resolves to .*now resolves to config"):
        write_manifest(other)
    assert (root / "sweep.json").read_text() == before
