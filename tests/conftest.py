"""Fixtures shared by the whole suite: a small packed dataset built once per session."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """A byte-level dataset from a handful of standard-library sources (builds in ~1 s)."""
    import json
    import sysconfig

    from luban.data.build import build_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py")]
    out = tmp_path_factory.mktemp("data") / "small"
    build_dataset([str(f) for f in files], out, tokenizer="byte")
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["kind"] == "byte"
    return out


def tiny_toml(run, train: dict, parallel: dict | None = None, run_keys: dict | None = None) -> str:
    """A config file for subprocess tests: a 1-layer, 32-wide tiny model on the embedded corpus."""
    import json

    def table(name, keys):
        return [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]

    lines = table("model", {"preset": "tiny", "layers": 1, "hidden": 32, "heads": 2}) + table("data", {"path": ""})
    lines += table("train", train) + (table("parallel", parallel) if parallel else [])
    return "\n".join(lines + table("run", {"dir": str(run), **(run_keys or {})})) + "\n"
