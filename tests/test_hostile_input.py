"""Hostile input under a memory bound: an absurd document for ``data prepare``, a safetensors header whose
shapes disagree with config.json, and a global batch far beyond the device's memory. Each ends in one
line (or a warning and a store without the document) and the process's peak RSS stays bounded; each runs
in a child process that reports its own peak (``VmHWM`` of ``/proc/self/status``)."""

import json
import os
import struct
import subprocess
import sys

import numpy as np

from hybrid_lm.config import CONFIGS_DIR

GiB = 1 << 30
# runs the hybrid-lm command line in this process, then prints the process's peak RSS in KiB: VmHWM, the peak of
# this program's own memory (getrusage's ru_maxrss would also count the pytest worker's RSS at the fork, which
# Linux carries across exec)
PEAK = ("import sys\nfrom hybrid_lm.cli import main\nrc = main(sys.argv[1:])\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
        "print('PEAK_KIB', hwm, file=sys.stderr)\nsys.exit(rc)\n")


def _cli_peak(*args, cwd=None):
    r = subprocess.run([sys.executable, "-c", PEAK, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    lines = r.stderr.strip().splitlines()
    peak = int(lines[-1].split()[1]) * 1024
    return r.returncode, r.stdout, "\n".join(lines[:-1]), peak


def test_a_huge_document_of_nul_bytes_is_skipped_with_a_warning_in_bounded_memory(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    with open(docs / "nul.txt", "wb") as fh:  # 256 MiB of NUL bytes, one document (a sparse file: no disk)
        fh.truncate(256 << 20)
    (docs / "fine.txt").write_text("a short ordinary document\n" * 40)
    rc, out, err, peak = _cli_peak("data", "prepare", "--source", "text", "--path", docs, "--out", tmp_path / "store",
                                   "--workers", "1", "--no-progress")
    assert rc == 0, err[-2000:]
    warned = [line for line in err.splitlines() if "nul.txt" in line]
    assert len(warned) == 1 and "256 MiB" in warned[0] and "--max-document-mb" in warned[0], err
    stats = json.loads((tmp_path / "store" / "stats.json").read_text())
    assert stats["skipped"]["oversize_skipped"] == 1 and stats["source_counts"]["documents"] == 1, stats["skipped"]
    assert peak < 1 * GiB, f"peak RSS {peak / GiB:.2f} GiB"
    # asked for: the limit raised, the document is read (not run here: it is what the limit keeps out)
    rc, _, err, _ = _cli_peak("data", "prepare", "--source", "text", "--path", docs, "--out", tmp_path / "store2",
                              "--max-document-mb", "0", "--no-progress")
    assert rc == 2 and "--max-document-mb" in err.strip().splitlines()[-1]


def _hostile_hf_folder(tmp_path, rows: int):
    """An exported tiny llama folder whose safetensors header declares embed_tokens as [rows, 64] (the data a
    sparse region of the file: nothing on disk)."""
    from safetensors.numpy import load_file

    from hf_families import random_params, tiny_model
    from hybrid_lm.run.hf import write_hf_folder

    model = tiny_model("llama")
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_folder(out, model, random_params(model), tokenizer="byte", seq_len=32)
    sd = load_file(str(out / "model.safetensors"))
    header, blobs, at = {}, [], 0
    for name, a in sd.items():
        if name == "model.embed_tokens.weight":
            continue
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    big = rows * 64 * 4
    header["model.embed_tokens.weight"] = {"dtype": "F32", "shape": [rows, 64], "data_offsets": [at, at + big]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
        fh.truncate(8 + len(text) + at + big)
    return out


def test_an_hf_header_shape_against_config_json_is_refused_before_any_tensor_is_read(tmp_path):
    out = _hostile_hf_folder(tmp_path, rows=10_000_000)  # 2.4 GiB declared
    rc, _, err, peak = _cli_peak("eval", f"hf:{out}", "--no-record")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "model.embed_tokens.weight" in last and "[10000000, 64]" in last and "[320, 64]" in last, err
    assert peak < 1 * GiB, f"peak RSS {peak / GiB:.2f} GiB"


def test_a_global_batch_beyond_the_device_memory_is_refused_before_the_run_dir(tmp_path):
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.memory import step_memory_floor

    gin = str(CONFIGS_DIR / "quickstart.gin")
    floor = step_memory_floor(load_config([gin], ["TrainConfig.global_batch = 65536"]))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    batch = 65536 * max(1, -(-2 * total // floor))  # at least twice this machine's memory
    work = tmp_path / "run"
    rc, _, err, peak = _cli_peak("train", gin, "--gin_param", f"TrainConfig.global_batch = {batch}",
                                 "--workdir", work)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "TrainConfig.global_batch" in lines[0] and "microbatches" in lines[0], err
    assert not work.exists()
    assert peak < 1 * GiB, f"peak RSS {peak / GiB:.2f} GiB"
