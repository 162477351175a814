"""The end-to-end comparison (``obskernels.bench.oneshot``) at a tiny shape on
the CPU: llm-compressor's own ``oneshot``, plain and with the drop-in.

Runs where llm-compressor 0.14 is importable (`make test-llmcompressor`);
elsewhere the module is skipped with the reason.
"""

import pytest

pytest.importorskip(
    "llmcompressor",
    reason="llm-compressor is not installed here; `make test-llmcompressor` runs this test "
    "in its own environment (.venv-llmcompressor)",
)

from obskernels.bench import oneshot  # noqa: E402

TINY = oneshot.Shape(layers=1, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=96, samples=2, seq=16)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_oneshot_comparison_times_both_modes_and_compares_their_qparams(monkeypatch, tmp_path):
    from obskernels import ops

    # a Triton cache of this test's own (the fresh processes inherit it): what
    # the calls compile, counted from it, is theirs alone
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))

    calls = []
    real = ops.min_max
    monkeypatch.setattr(ops, "min_max", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = oneshot.run_once("FP8", "plain", TINY, "cpu")
    assert not calls, "plain llm-compressor must not reach obskernels"
    ours = oneshot.run_once("FP8", "drop-in", TINY, "cpu")
    # 7 Linear layers: weight and input activation observers went through obskernels
    assert len(calls) >= 14
    assert plain["seconds"] > 0 and ours["seconds"] > 0
    assert plain["qparams"] and sorted(plain["qparams"]) == sorted(ours["qparams"])

    rows = oneshot.compare(["FP8"], TINY, "cpu", reps=0, fresh=True, fresh_reps=1)
    assert [r["mode"] for r in rows] == ["plain", "drop-in"]
    for r in rows:
        assert r["first_in_process_s"] > 0 and r["fresh_process_s"] > 0 and r["repeat_s"] is None
        assert r["fresh_process_samples"] == [r["fresh_process_s"]]
        # on the CPU neither mode compiles a kernel (the drop-in's triton backend
        # runs on CUDA tensors; here, under the interpreter, if at all)
        assert r["first_in_process_compiled"] == [] and r["fresh_process_compiled"] == [[]], r
        # nor sets up a kernel variant: none the fresh process set up is new
        assert r["fresh_process_unseen"] == [[]], r
        # min/max observers: bit-identical qparams with and without the drop-in
        assert r["qparam_tensors"] == len(plain["qparams"]) and r["qparams_identical"] == r["qparam_tensors"]
    text = oneshot.table(rows, oneshot._provenance("cpu", TINY, "auto", "basic"))
    assert "MEASURED on the CPU" in text and "llmcompressor" in text


def test_a_profiled_fresh_process_is_summarised_by_part(tmp_path):
    """``--profile-fresh``: one more fresh process per row, its ``oneshot``
    call profiled; the summary has every part of ``FIRST_USE_PARTS`` and
    the functions by cumulative time, llm-compressor's ``oneshot`` and the
    drop-in's observer calls among them."""
    rows = oneshot.compare(["FP8"], TINY, "cpu", reps=0, fresh=False, profile_dir=str(tmp_path))
    paths = [r["fresh_profile"] for r in rows]
    assert paths == [str(tmp_path / "FP8-plain.txt"), str(tmp_path / "FP8-drop-in.txt")]
    plain, ours = (open(p).read() for p in paths)
    for text in (plain, ours):
        for part in oneshot.FIRST_USE_PARTS:
            assert f"  {part}: " in text, text[:2000]
        assert "(oneshot)" in text
    # the drop-in's process called obskernels' ops; plain never did
    assert "obskernels/ops.py" in ours and "obskernels/ops.py" not in plain
    # what `make gpu-check` puts in its summary: the by-part lines
    parts = oneshot.profile_parts(paths[1])
    assert parts[0] == "part: cumulative s (calls)" and len(parts) == 1 + len(oneshot.FIRST_USE_PARTS)
    assert [line.split(": ")[0].strip() for line in parts[1:]] == list(oneshot.FIRST_USE_PARTS)


def test_the_table_shows_where_a_call_compiled_kernels():
    """A call that compiled kernels into Triton's disk cache says how many
    after its seconds (a fresh process should compile none), and a fresh
    process how many kernel variants it set up that the parent never did;
    one that did neither, or where neither could be known, shows its seconds
    alone."""
    base = dict(scheme="FP8", repeat_s=0.3, reps=3, fresh_process_s=1.5, qparam_tensors=168,
                qparams_identical=168)
    rows = [dict(base, mode="plain", first_in_process_s=0.245, first_in_process_compiled=None,
                 fresh_process_samples=[0.603, 0.884], fresh_process_compiled=[None, None]),
            dict(base, mode="drop-in", first_in_process_s=2.157,
                 first_in_process_compiled=["_min_max_kernel"] * 3 + ["_qparams_kernel"],
                 fresh_process_samples=[2.18, 0.778], fresh_process_compiled=[["_min_max_kernel"] * 2, []],
                 fresh_process_unseen=[[["_min_max_kernel", "{}"]], []])]
    lines = oneshot.table(rows, oneshot._provenance("cpu", TINY, "auto", "basic")).splitlines()
    plain, ours = (next(line for line in lines if f"  {mode} " in line) for mode in ("plain", "drop-in"))
    assert "compiled" not in plain and "0.245" in plain and "0.603, 0.884" in plain, plain
    assert "2.157 (4 compiled)" in ours and "2.180 (2 compiled, 1 unseen), 0.778" in ours, ours


def test_a_fresh_process_names_the_variants_its_parent_never_set_up(monkeypatch):
    """``fresh_process_unseen``: per fresh process, the kernel variants it
    set up that no call of the comparing process did (any mode, any call:
    a process sets a variant up once), by digest; None where either side
    could not be known."""
    import torch

    made = {("plain", False): {}, ("drop-in", False): {"d1": ["_min_max_kernel", "a"]}}
    calls = iter([{"d2": ["_qparams_kernel", "b"]}, {}])  # a repeated call sets one more up

    def fake_run_once(scheme, mode, *args, **kwargs):
        variants = made.pop((mode, False), None)
        if variants is None:
            variants = next(calls)
        return {"seconds": 0.1, "qparams": {"w_scale": torch.ones(1)}, "variants": variants}

    children = iter([
        {"seconds": 0.5, "variants": {}},  # plain
        {"seconds": 2.0, "variants": {"d1": ["_min_max_kernel", "a"], "d3": ["_min_max_kernel", "c"]}},
        {"seconds": 0.7, "variants": {"d1": ["_min_max_kernel", "a"], "d2": ["_qparams_kernel", "b"]}},
        {"seconds": 0.6, "variants": None},  # plain, where Triton did not import
    ])
    monkeypatch.setattr(oneshot, "run_once", fake_run_once)
    monkeypatch.setattr(oneshot, "_child", lambda *a, **k: next(children))
    plain, ours = oneshot.compare(["FP8"], TINY, "cpu", reps=1, fresh=True, fresh_reps=2)
    assert ours["fresh_process_samples"] == [2.0, 0.7] and plain["fresh_process_samples"] == [0.5, 0.6]
    assert ours["fresh_process_unseen"] == [[["_min_max_kernel", "c"]], []], ours
    assert plain["fresh_process_unseen"] == [[], None], plain
    # what the first call set up, to compare an unseen variant with
    assert ours["first_in_process_variants"] == [["_min_max_kernel", "a"]], ours
    assert plain["first_in_process_variants"] == [], plain
