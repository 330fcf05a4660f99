#!/usr/bin/env python3
"""A draft model for --speculative_algorithm draft cut from a served model: some of its decoder layers (the first N,
or ranges: keeping the last layers, which map hidden states onto the vocabulary, accepts far more than cutting them,
as layer-skipping self-speculation finds), with its embeddings, final norm and lm_head, tokenizer and chat template
as they are. Cheap to make, no training: the kind of draft the speculative benchmark measures
(scripts/bench_speculative.py), not a good one (a trained small model of the same tokenizer accepts more).

    python scripts/make_draft_model.py --layers 0-3,26-29 --out ~/.cache/lightserve/draft-8
    (default --model_dir: the bundled SmolLM2-135M-Instruct, converted once)
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_draft(model_dir: Path, layers: list[int], out_dir: Path) -> Path:
    """Write the draft of `model_dir`'s decoder layers `layers` (in that order, renumbered from 0) to out_dir (an HF
    folder); returns out_dir. ValueError for a layer the model does not have."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not layers or not all(0 <= i < total for i in layers):
        raise ValueError(f"the layers must be in [0, {total}), got {layers}")
    new_index = {old: new for new, old in enumerate(layers)}
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():  # tokenizer, chat template, generation config
        weights = f.suffix == ".safetensors" or f.name.startswith("model.safetensors")
        if f.is_file() and not weights and f.name != "config.json" and not f.name.startswith("."):
            shutil.copy2(f, out_dir / f.name)
    config["num_hidden_layers"] = len(layers)
    for key in ("layer_types",):  # per-layer lists keep the chosen layers' entries
        if isinstance(config.get(key), list):
            config[key] = [config[key][i] for i in layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                m = LAYER.match(name)
                if m is None:
                    tensors[name] = f.get_tensor(name)
                elif int(m.group(1)) in new_index:
                    tensors[f"model.layers.{new_index[int(m.group(1))]}.{name[m.end():]}"] = f.get_tensor(name)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def parse_layers(text: str) -> list[int]:
    """'8' -> the first 8 layers; '0-3,26-29' -> those ranges, inclusive."""
    if text.isdigit():
        return list(range(int(text)))
    layers = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        layers += list(range(int(lo), int(hi or lo) + 1))
    return layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", type=Path, help="an HF folder (default: the bundled model's float32 conversion)")
    ap.add_argument("--layers", required=True, help="decoder layers to keep, e.g. 8 (the first 8) or 0-3,26-29")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.model_dir is None:
        from lightserve.engine.model_prep import ensure_default_model
        args.model_dir = ensure_default_model()
    make_draft(args.model_dir, parse_layers(args.layers), args.out.expanduser())
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
