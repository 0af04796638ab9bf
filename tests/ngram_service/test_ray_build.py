"""The distributed trie build (``python -m ngram_service.build --ray``): byte-identical to the
single-machine build across options and spilled runs, resumable from finished partitions,
a killed task retried, and its C++ pieces checked on their own."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from ngram_service import _native
from ngram_service.build import build_trie_from_texts
from ngram_service.tokenizer import load_trie_tokenizer
from ngram_service.trie import NgramTrie, pack_ragged

ray = pytest.importorskip("ray")
from ngram_service.ray_build import RayBuildError, _Scratch, build_trie_ray, partition_boundaries  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while def return import class self print value for "
         "if else None True False 0 1 2 x y").split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 120)))
        out.append(body + ("\n    return x\n" if i % 3 == 0 else "") + ("" if i % 7 else "\u00e9t\u00e9 \U0001f600"))
    return out


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, namespace="dart-serve-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    return load_trie_tokenizer()


@pytest.fixture(autouse=True)
def fixed_time(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the header's created_unix: the same in both builds


@pytest.mark.parametrize("options", [
    dict(order=4, min_count=2),
    dict(order=3, max_tokens=20_000, eos_per_document=True, documents="snapshot"),
    dict(order=2, special_tokens=True, min_count=3, prune="reference"),
    dict(order=5),
])
def test_the_distributed_build_writes_the_single_machine_builds_bytes(local_ray, tokenizer, tmp_path, options):
    options = dict(options)
    if options.get("documents") == "snapshot":
        rng = np.random.default_rng(1)
        options["documents"] = [rng.integers(0, tokenizer.vocab_size, size=n) for n in (0, 5, 300, 40)]
    texts = _texts(1500)
    single = build_trie_from_texts(texts, tmp_path / "single.trie", tokenizer, memory_mb=1, progress=False, **options)
    dist = build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, memory_mb=0.02, progress=False, shard_chars=20_000,
                          partitions=5, **options)
    assert (tmp_path / "ray.trie").read_bytes() == (tmp_path / "single.trie").read_bytes()
    assert dist.num_nodes == single.num_nodes and dist.total_tokens == single.total_tokens
    assert dist.num_documents == single.num_documents
    assert dist.shards > 3 and dist.partitions == 5
    if options["order"] == 4:  # several runs spilled per partition: the external merge is exercised
        assert dist.num_runs > 2 * dist.partitions and dist.spilled_bytes > 0
    assert not (tmp_path / ".ray.trie.ray-build").exists()  # scratch cleaned on success
    NgramTrie(tmp_path / "ray.trie", verify=True)


def test_a_killed_build_resumes_from_its_finished_partitions(local_ray, tokenizer, tmp_path, monkeypatch):
    texts = _texts(800, seed=2)
    build_trie_from_texts(texts, tmp_path / "single.trie", tokenizer, order=3, progress=False)
    real_save = _Scratch.save
    saved = []

    def save_then_die(self, p, stats, arrays):
        real_save(self, p, stats, arrays)
        saved.append(p)
        if len(saved) == 2:
            raise KeyboardInterrupt  # the driver killed after two partitions were kept

    monkeypatch.setattr(_Scratch, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, partitions=4, shard_chars=20_000,
                       progress=False)
    monkeypatch.setattr(_Scratch, "save", real_save)
    assert not (tmp_path / "ray.trie").exists()
    with pytest.raises(RayBuildError, match="another corpus or other options"):
        build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=4, resume=True, progress=False)
    summary = build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, partitions=4, shard_chars=20_000,
                             resume=True, progress=False)
    assert summary.resumed_partitions == 2 and summary.partitions == 4
    assert (tmp_path / "ray.trie").read_bytes() == (tmp_path / "single.trie").read_bytes()


def test_a_task_killed_mid_partition_is_retried(local_ray, tokenizer, tmp_path):
    texts = _texts(600, seed=3)
    build_trie_from_texts(texts, tmp_path / "single.trie", tokenizer, order=3, progress=False)
    marker = tmp_path / "killed-once"
    build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, partitions=3, shard_chars=20_000,
                   progress=False, _fault={"partition": 1, "marker": str(marker)})
    assert marker.exists()  # the worker did die, after its first run
    assert (tmp_path / "ray.trie").read_bytes() == (tmp_path / "single.trie").read_bytes()


def test_the_cli_builds_the_same_file_with_ray(tokenizer, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in _texts(400, seed=4)))
    env = {**__import__("os").environ, "SOURCE_DATE_EPOCH": "1700000000"}
    run = [sys.executable, "-m", "ngram_service.build", str(corpus), "--order", "3", "-q"]
    one = subprocess.run([*run, "-o", str(tmp_path / "one.trie")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert one.returncode == 0, one.stderr
    dist = subprocess.run([*run, "-o", str(tmp_path / "ray.trie"), "--ray", "--workers", "2", "--partitions", "3"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert dist.returncode == 0, dist.stderr
    summary = json.loads(dist.stdout)
    assert summary["partitions"] == 3 and set(summary["stages"]) == {"read", "sample", "map", "reduce", "write"}
    assert (tmp_path / "ray.trie").read_bytes() == (tmp_path / "one.trie").read_bytes()


def test_partition_boundaries_balance_the_sample():
    hist = np.array([0, 10, 10, 10, 10, 0, 10, 10, 10, 10], dtype=np.int64)
    b = partition_boundaries(hist, 4)
    assert b.tolist() == [3, 5, 8]
    assert [int(hist[lo:hi].sum()) for lo, hi in zip([0, *b], [*b, len(hist)])] == [20, 20, 20, 20]
    heavy = np.array([1, 1000, 1, 1, 1], dtype=np.int64)  # one token heavier than a share stays whole
    assert partition_boundaries(heavy, 4).tolist() == [2]
    assert partition_boundaries(np.zeros(5, np.int64), 4).size == 0
    assert partition_boundaries(hist, 1).size == 0


def test_counted_windows_equal_the_documents_they_came_from(tmp_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 30, size=rng.integers(0, 25)).astype(np.uint32) for _ in range(200)]
    flat, offsets = pack_ragged(docs)
    direct = _native.TrieBuilder(3, 30, str(tmp_path), 1 << 20)
    direct.add_documents(flat.astype(np.uint32), offsets)
    direct.finish(str(tmp_path / "direct.trie"), "{}", 1)
    keys, counts, starts = _native.count_windows(3, 30, flat.astype(np.uint32), offsets, np.array([10, 20], np.uint32))
    assert starts.tolist()[0] == 0 and starts.tolist()[-1] == len(counts) and len(starts) == 4
    assert (keys[starts[1]:starts[2], 0] >= 10).all() and (keys[starts[1]:starts[2], 0] < 20).all()
    assert int(counts.sum()) == len(flat)
    counted = _native.TrieBuilder(3, 30, str(tmp_path), 1 << 10)
    order = rng.permutation(len(counts))  # any order, several spilled runs
    counted.add_counted(keys[order], counts[order])
    counted.finish(str(tmp_path / "counted.trie"), "{}", 1)
    assert (tmp_path / "counted.trie").read_bytes() == (tmp_path / "direct.trie").read_bytes()


@pytest.mark.parametrize("key,count,message", [
    ([[0xFFFFFFFF, 1, 2]], 1, "not a window"),  # padding first
    ([[1, 0xFFFFFFFF, 2]], 1, "not a window"),  # a token after padding
    ([[1, 2, 30]], 1, "not a window"),  # outside the vocabulary
    ([[1, 2, 3]], 0, "count 0"),
])
def test_malformed_counted_windows_are_refused(tmp_path, key, count, message):
    builder = _native.TrieBuilder(3, 30, str(tmp_path), 1 << 20)
    with pytest.raises(ValueError, match=message):
        builder.add_counted(np.array(key, np.uint32), np.array([count], np.uint64))


@pytest.mark.parametrize("kwargs,message", [
    (dict(order=7), "order"),
    (dict(partitions=0), "partitions"),
    (dict(num_cpus=0), "num_cpus"),
    (dict(memory_mb=0), "memory_mb"),
])
def test_bad_options_are_refused_before_any_work(tokenizer, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_trie_ray(["some text"], tmp_path / "x.trie", tokenizer, progress=False, **kwargs)
    assert not (tmp_path / "x.trie").exists()


def test_the_cli_refuses_zero_workers_with_ray(tmp_path):
    (tmp_path / "a.txt").write_text("text " * 50)
    r = subprocess.run([sys.executable, "-m", "ngram_service.build", str(tmp_path / "a.txt"), "-o",
                        str(tmp_path / "x.trie"), "--ray", "--workers", "0", "-q"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "num_cpus must be >= 1" in r.stderr


def test_a_damaged_partition_is_built_again_on_resume(local_ray, tokenizer, tmp_path, monkeypatch):
    """A kept partition whose level file is cut short (a disk that filled, a copy gone wrong) is not
    trusted: --resume builds it again and the file is still the single-machine build's."""
    texts = _texts(500, seed=6)
    build_trie_from_texts(texts, tmp_path / "single.trie", tokenizer, order=3, progress=False)
    real_save = _Scratch.save

    def save_then_die(self, p, stats, arrays):
        real_save(self, p, stats, arrays)
        raise KeyboardInterrupt

    monkeypatch.setattr(_Scratch, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, partitions=3, progress=False)
    monkeypatch.setattr(_Scratch, "save", real_save)
    (kept,) = (tmp_path / ".ray.trie.ray-build").glob("part-*/level2.tokens")
    kept.write_bytes(kept.read_bytes()[:-4])
    summary = build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, partitions=3, resume=True,
                             progress=False)
    assert summary.resumed_partitions == 0
    assert (tmp_path / "ray.trie").read_bytes() == (tmp_path / "single.trie").read_bytes()


def test_a_full_disk_names_the_node_and_the_limit(local_ray, tokenizer, tmp_path):
    """Reduce tasks spilling to a 1 MiB tmpfs: the build fails with the node, the folder, the space
    left and --memory-mb, and keeps nothing half-written at the output."""
    spill = tmp_path / "small-disk"
    spill.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(spill)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a 1 MiB tmpfs cannot be mounted here: {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(RayBuildError) as failure:
            build_trie_ray(_texts(1500, seed=7), tmp_path / "ray.trie", tokenizer, order=4, partitions=2,
                           memory_mb=0.01, task_tmp_dir=str(spill), progress=False)
        message = str(failure.value)
        assert "No space left on device" in message and "on node" in message and str(spill) in message
        assert "GiB free" in message and "--memory-mb 0.01" in message and "--resume" in message
        assert not (tmp_path / "ray.trie").exists()
    finally:
        subprocess.run(["umount", "--lazy", str(spill)], capture_output=True)  # a Ray worker may still hold it


def test_a_task_killed_for_memory_names_the_node_and_the_limit(local_ray, tokenizer, tmp_path, monkeypatch):
    """A reduce task that Ray's memory monitor kills (Ray raises OutOfMemoryError, whose message names the
    node; raised here by a stand-in, since a real kill needs the node itself short of memory): the build fails
    with that message, --memory-mb and what to change, keeps its finished partitions for --resume, and
    writes nothing at the output."""
    from ngram_service.ray_build import _RayBuild

    def killed(self, shard_runs, needed, done):
        raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory. "
                                              "Memory on the node (IP: 10.0.0.7, ID: abc) where the task was running")

    monkeypatch.setattr(_RayBuild, "reduce", killed)
    with pytest.raises(RayBuildError) as failure:
        build_trie_ray(_texts(200, seed=9), tmp_path / "ray.trie", tokenizer, order=3, partitions=2, memory_mb=64,
                       progress=False)
    message = str(failure.value)
    assert "IP: 10.0.0.7" in message and "--memory-mb 64" in message and "--partitions" in message
    assert "--resume" in message and not (tmp_path / "ray.trie").exists()


def test_one_progress_bar_follows_the_whole_build(local_ray, tokenizer, tmp_path, capsys):
    """One bar across the build: documents counted, the stage described, tokens and partitions in
    its postfix (no separate bar per stage)."""
    texts = _texts(300)
    summary = build_trie_ray(texts, tmp_path / "ray.trie", tokenizer, order=3, progress=True, shard_chars=20_000,
                             partitions=3)
    err = capsys.readouterr().err
    assert "ray build: map" in err and "ray build: reduce" in err and "ray build: write" in err
    assert "partitions=3/3" in err and f"{summary.num_documents} documents" in err
    assert "merge" not in err and "tokenise+count" not in err
