"""The demo's cases ship with the package, so a clone with nothing beside it runs the demo."""

from __future__ import annotations

import json

from ragblend.bench import datasets


def test_the_shipped_demo_cases_are_musique_cases_with_ten_passages():
    cases = json.loads(datasets.DEMO_DATASET.read_text())
    assert len(cases) >= 3  # the demo answers 3 questions by default
    for case in cases:
        assert case["question"] and case["answers"]
        assert len(case["ctxs"]) == 10 and all(c["text"] for c in case["ctxs"])
    assert "CC BY 4.0" in (datasets.DEMO_DATASET.parent / "README.md").read_text()


def test_without_the_dev_cases_beside_the_checkout_the_default_is_the_shipped_sample(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(datasets, "DEV_DATASET", tmp_path / "missing.json")
    assert datasets.default_dataset() == datasets.DEMO_DATASET
    present = tmp_path / "musique_dev.json"
    present.write_text("[]")
    monkeypatch.setattr(datasets, "DEV_DATASET", present)
    assert datasets.default_dataset() == present
