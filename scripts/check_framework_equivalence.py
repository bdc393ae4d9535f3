"""Layer-by-layer equivalence of the engine's frameworks with Hugging Face, in float32, on real prompts.

    .venv/bin/python scripts/check_framework_equivalence.py [--model PATH] [--frameworks jax,tinygrad]
        [--tiny llama|gpt2] [--prompt TEXT ...]

For each prompt, Hugging Face's model gives the reference: the embeddings, the residual stream after each block
(its decoder layers' outputs, read with forward hooks), the final norm and the logits. Each framework's
``layer_outputs`` (``app.engine.frameworks.<name>.runner``) gives the same points from the same weights, and the
table prints the largest absolute error at each point, with the reference's largest magnitude beside it (the
residual stream of SmolLM2 reaches ~2.4e4 in its last blocks, where float32 itself moves by ~1e-3). The default
model is SmolLM2-135M-Instruct (its converted HF folder); ``--tiny`` uses a random-weight tiny model instead.
Exit status 1 when a framework's logits are off by more than ``--logits-tolerance`` (default 1e-3).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea, then explain why the sea is salty in two sentences.",
]


def hf_points(hf: Any, ids: list[int]) -> dict[str, np.ndarray]:
    """Hugging Face's embeddings, block outputs, final norm and logits for one sequence."""
    body = hf.model if hasattr(hf, "model") else hf.transformer
    blocks = body.layers if hasattr(body, "layers") else body.h
    norm = body.norm if hasattr(body, "norm") else body.ln_f
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    handles = [block.register_forward_hook(keep(f"block.{i}")) for i, block in enumerate(blocks)]
    handles.append(norm.register_forward_hook(keep("final_norm")))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    points = {"embeddings": out.hidden_states[0][0].float().numpy()}
    points.update({name: value[0].float().numpy() for name, value in seen.items()})
    points["logits"] = out.logits[0].float().numpy()
    return points


def framework_points(name: str, model: Any, config: Any, ids: list[int]) -> dict[str, np.ndarray] | str:
    """A framework's points, or why it could not give them (not installed, no layer_outputs)."""
    try:
        runner = importlib.import_module(f"app.engine.frameworks.{name}.runner")
    except ImportError as exc:
        return f"not available ({exc.name or exc}): pip install 'inf-engine[{name}]'"
    outputs = runner.layer_outputs(model, config, ids)
    return {key: np.asarray(value, dtype=np.float32) for key, value in outputs.items()}


def order(points: dict[str, np.ndarray]) -> list[str]:
    blocks = sorted((k for k in points if k.startswith("block.")), key=lambda k: int(k.split(".")[1]))
    return ["embeddings", *blocks, "final_norm", "logits"]


def load(args: argparse.Namespace, tmp: Path) -> tuple[Any, Any, Any, Any]:
    """(HF model, our float32 torch model, its ModelConfig, tokenizer)."""
    from transformers import AutoModelForCausalLM

    from app.engine.loading import default_model_folder, load_model

    if args.tiny:
        from tests.support.engine_models import build_hf_model, save_hf_model

        folder = save_hf_model(build_hf_model("gpt2" if args.tiny == "gpt2" else "llama_gqa_llama3"), tmp / "tiny")
    else:
        folder = Path(args.model) if args.model else default_model_folder()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, tokenizer, config = load_model(folder, dtype=torch.float32, device="cpu")
    return hf, model, config, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an HF folder (default: SmolLM2-135M-Instruct's converted folder)")
    parser.add_argument("--tiny", choices=("llama", "gpt2"), help="a random-weight tiny model instead")
    parser.add_argument("--frameworks", default="jax,tinygrad")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat; default: two English prompts)")
    parser.add_argument("--logits-tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf, model, config, tokenizer = load(args, Path(tmp))
        for prompt in args.prompt or PROMPTS:
            ids = tokenizer.encode(prompt) if not args.tiny else [int(b) % config.vocab_size for b in prompt.encode()]
            reference = hf_points(hf, ids)
            results = {name: framework_points(name, model, config, ids) for name in names}
            print(f"\n{config.name or config.architecture}: {prompt!r} ({len(ids)} tokens); max |ours - HF| per point")
            print(f"{'point':<12} {'|HF| max':>10} " + " ".join(f"{n:>12}" for n in names))
            for point in order(reference):
                ref = reference[point]
                cells = []
                for name in names:
                    got = results[name]
                    if isinstance(got, str) or point not in got:
                        cells.append(f"{'-':>12}")
                        continue
                    error = float(np.abs(got[point].reshape(ref.shape) - ref).max())
                    if point == "logits":
                        worst[name] = max(worst.get(name, 0.0), error)
                    cells.append(f"{error:>12.2e}")
                print(f"{point:<12} {float(np.abs(ref).max()):>10.3g} " + " ".join(cells))
            for name, got in results.items():
                if isinstance(got, str):
                    print(f"  {name}: {got}")
    failed = [n for n, e in worst.items() if e > args.logits_tolerance]
    print("\nlogits within {:.0e}: {}".format(args.logits_tolerance, ", ".join(
        f"{n} {'yes' if worst[n] <= args.logits_tolerance else 'NO'} ({worst[n]:.2e})" for n in worst) or "none ran"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
