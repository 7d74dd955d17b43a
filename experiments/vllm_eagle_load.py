"""Load an exported EAGLE-3 head (spectoolkit.models.eagle3_head) with vLLM's own eagle3 model and loader.

    .venv/bin/python -c "..."  # export a head: Eagle3Head(...).save(DIR)
    .venv-vllm/bin/python experiments/vllm_eagle_load.py --target ~/.cache/spectoolkit/smollm2-135m-instruct --head DIR

vLLM (``make vllm``'s venv, vLLM 0.32 CPU) builds ``Eagle3LlamaForCausalLM`` from the head's config.json as
``speculative_config`` method ``eagle3`` over the target, loads our safetensors with its ``load_weights``, and
the script checks that every tensor landed where ours says: fc, the stacked q/k/v and gate/up, the norms,
lm_head and the draft→target offsets. Its forward needs an engine's attention metadata, so logits are
compared in our own tests (tests/models/test_eagle3_head.py), not here.
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import load_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True)
    args = parser.parse_args()
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    model_config, parallel = ModelConfig(model=args.target, dtype="float32"), ParallelConfig()
    speculative = SpeculativeConfig(method="eagle3", model=args.head, num_speculative_tokens=3,
                                    target_model_config=model_config, target_parallel_config=parallel)  # fmt: skip
    config = VllmConfig(model_config=model_config, speculative_config=speculative, parallel_config=parallel)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29533", 0, "gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        model = Eagle3LlamaForCausalLM(vllm_config=config)
        ours = load_file(os.path.join(args.head, "model.safetensors"))
        model.load_weights(iter(ours.items()))
    theirs = dict(model.named_parameters())
    layer = "model.layers.0."
    checks = {
        "fc": ("model.fc.weight", ours["fc.weight"]),
        "q/k/v": (layer + "self_attn.qkv_proj.weight",
                  torch.cat([ours[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"])),
        "o": (layer + "self_attn.o_proj.weight", ours["midlayer.self_attn.o_proj.weight"]),
        "gate/up": (layer + "mlp.gate_up_proj.weight",
                    torch.cat([ours["midlayer.mlp.gate_proj.weight"], ours["midlayer.mlp.up_proj.weight"]])),
        "down": (layer + "mlp.down_proj.weight", ours["midlayer.mlp.down_proj.weight"]),
        "hidden_norm": (layer + "hidden_norm.weight", ours["midlayer.hidden_norm.weight"]),
        "input_layernorm": (layer + "input_layernorm.weight", ours["midlayer.input_layernorm.weight"]),
        "post_attention_layernorm": (layer + "post_attention_layernorm.weight",
                                     ours["midlayer.post_attention_layernorm.weight"]),
        "norm": ("model.norm.weight", ours["norm.weight"]),
        "lm_head": ("lm_head.weight", ours["lm_head.weight"]),
        "d2t": ("draft_id_to_target_id", ours["d2t"]),
    }  # fmt: skip
    failed = [name for name, (key, want) in checks.items() if not torch.equal(theirs[key].data, want)]
    print("vLLM loaded every tensor where ours says" if not failed else f"MISMATCH: {', '.join(failed)}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
