"""α under structured outputs: the draft proposing under the grammar's mask (the runtime's way) against proposing from
its own logits, unmasked (the steps graph's way), on a JSON-schema workload, and α without a grammar beside them.

A tiny random llama pair whose agreement is dialled as tests/test_sampling.py dials it: the draft is the target's first
layer, the target's three later layers write 0.3 times their usual output. The output is the same either way (the
target's under the mask: tests/test_structured.py); only how many drafts hold differs.

    python benchmarks/structured_alpha.py --scratch /tmp/structured --json structured.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compile_scale import tokenizer
from layer_pair import tail_scale

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["def add(a, b):\n    return", "Describe a person as JSON:", "class Stack:\n    def __init__(self):\n",
           "import textwrap\n", "The answer is", "x = [1, 2, 3]\nprint(x"]


def pair(scratch: Path) -> Path:
    """Compile the pair (once) and return its bundle folder."""
    import torch
    import transformers as tf

    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    bundle = scratch / "bundle"
    if bundle.exists():
        return bundle
    tok = tokenizer()
    torch.manual_seed(0)
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    target = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=4, **config))
    damped = tail_scale(1, 0.3)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15).mul_(damped(name))
    draft = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, **config))
    draft.load_state_dict(target.state_dict(), strict=False)
    for name, model in (("target", target), ("draft", draft)):
        model.eval().save_pretrained(scratch / name)
        tok.save_pretrained(scratch / name)
    compile_bundle(CompileSettings(scratch / "target", scratch / "draft", bundle, max_seq_len=256), show_progress=False)
    return bundle


def alpha(decoder, options: dict, seeds: int) -> dict:
    runs = [decoder.generate(prompt, 64, 4, seed=seed, **options) for prompt in PROMPTS for seed in range(seeds)]
    accepted, drafted = sum(r.stats.accepted for r in runs), sum(r.stats.drafted for r in runs)
    return {"alpha": round(accepted / max(drafted, 1), 3), "drafted": drafted,
            "tokens": sum(len(r.token_ids) for r in runs), "texts": [r.text for r in runs[:2]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, required=True, help="where the pair and its bundle go (a few MB)")
    parser.add_argument("--seeds", type=int, default=4, help="sampled runs per prompt")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(pair(args.scratch))
    masked_draft = SpeculativeDecoder._draft

    def unmasked_draft(slot, feed, total_len, k, uniforms, greedy, guide=None):
        return masked_draft(slot, feed, total_len, k, uniforms, greedy)

    results = {}
    for sampling, options in (("greedy", {"temperature": 0.0}), ("sampled T=1", {"temperature": 1.0})):
        seeds = 1 if sampling == "greedy" else args.seeds
        results[sampling] = {"no grammar": alpha(decoder, options, seeds),
                             "masked draft": alpha(decoder, {**options, "structured_outputs": {"json": SCHEMA}}, seeds)}
        SpeculativeDecoder._draft = staticmethod(unmasked_draft)
        try:
            results[sampling]["unmasked draft"] = alpha(decoder, {**options, "structured_outputs": {"json": SCHEMA}}, seeds)
        finally:
            SpeculativeDecoder._draft = staticmethod(masked_draft)
        # Greedy, both give the target's tokens; sampled, the same distribution, drawn with other random numbers.
        same = results[sampling]["masked draft"]["texts"] == results[sampling]["unmasked draft"]["texts"]
        print(f"{sampling}: α {results[sampling]['no grammar']['alpha']} without a grammar, under the JSON schema "
              f"{results[sampling]['masked draft']['alpha']} with the draft masked, "
              f"{results[sampling]['unmasked draft']['alpha']} unmasked" + (f" (same texts: {same})" if seeds == 1 else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
