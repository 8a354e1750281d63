#!/usr/bin/env python3
"""Records one attention layer of a Hugging Face transformers model into a
reference file that `mha-parity --reference FILE` checks mha against.

The file is safetensors (format in docs/porting.md, "Prove your port"): the layer's input `hidden_states` (N, L, E), the model's
`attention_mask` (N, S) (1 = keep, as transformers), `position_ids` (N, L),
the attention module's `output` (N, L, E) (what mha::MultiHeadAttention
returns: before any residual) and per-head `weights` (N, H, L, S), plus the
tensors of that layer under their checkpoint names and, in __metadata__,
config.json, the layer and the T5 stack. Forward hooks on the attention module
take the values from the model's own forward; nothing is recomputed.

    python3 scripts/record_reference.py MODEL_DIR_OR_NAME --layer 3 \
        --text "Hello world" --out ref.safetensors

The model is run with attn_implementation="eager" (the per-head weights exist
only there) in float32, on the CPU.
"""

import argparse
import json

import torch
from safetensors.torch import save_file

FORMAT = "mha-attention-reference"
VERSION = "1"


def attention_module_name(model, layer, stack="encoder"):
    """The qualified name of the self-attention module of `layer`."""
    t = model.config.model_type
    names = {
        "llama": f"layers.{layer}.self_attn",
        "mistral": f"layers.{layer}.self_attn",
        "qwen2": f"layers.{layer}.self_attn",
        "qwen3": f"layers.{layer}.self_attn",
        "olmo2": f"layers.{layer}.self_attn",
        "gpt_oss": f"layers.{layer}.self_attn",
        "gemma3_text": f"layers.{layer}.self_attn",
        "qwen3_next": f"layers.{layer}.self_attn",
        "llama4_text": f"layers.{layer}.self_attn",
        "deepseek_v3": f"layers.{layer}.self_attn",
        "deepseek_v2": f"layers.{layer}.self_attn",
        "gptj": f"h.{layer}.attn",
        "gpt2": f"h.{layer}.attn",
        "gpt_neox": f"layers.{layer}.attention",
        "falcon": f"h.{layer}.self_attention",
        "bloom": f"h.{layer}.self_attention",
        "bert": f"encoder.layer.{layer}.attention.self",
        "t5": f"{stack}.block.{layer}.layer.0.SelfAttention",
    }
    if t not in names:
        raise SystemExit(f"model_type {t!r} is not one mha::hf reads")
    modules = dict(model.named_modules())
    for prefix in ("", model.base_model_prefix + ".", "model."):
        if prefix + names[t] in modules:
            return prefix + names[t]
    raise SystemExit(f"no module {names[t]!r} in the model")


def layer_tensors(model, module_name, stack):
    """The state-dict entries of the layer that holds `module_name` (T5: and
    its stack's shared relative_attention_bias)."""
    parts = module_name.split(".")
    # Cut after the layer index: model.layers.3.self_attn -> model.layers.3.
    for i, part in enumerate(parts):
        if part.isdigit():
            prefix = ".".join(parts[: i + 1]) + "."
            break
    state = model.state_dict()
    out = {k: v for k, v in state.items() if k.startswith(prefix)}
    if model.config.model_type == "t5":
        for k, v in state.items():
            if k.startswith(prefix.rsplit(".", 2)[0] + ".0.") and \
                    "relative_attention_bias" in k:
                out[k] = v
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def run_layer(model, module_name, inputs, with_weights=True):
    """Runs model(**inputs) and returns (hidden_states, output, weights) of
    the attention module `module_name`."""
    module = dict(model.named_modules())[module_name]
    seen = {}

    def pre_hook(_module, args, kwargs):
        seen["hidden_states"] = args[0] if args else kwargs["hidden_states"]
        residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
        seen["residual"] = residual

    def hook(_module, _args, _kwargs, output):
        seen["output"] = output[0] if isinstance(output, tuple) else output
        if isinstance(output, tuple) and len(output) > 1 and \
                model.config.model_type != "t5":
            seen["weights"] = output[1]
        elif isinstance(output, tuple) and len(output) > 2:
            seen["weights"] = output[2]

    handles = [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
               module.register_forward_hook(hook, with_kwargs=True)]
    try:
        with torch.no_grad():
            result = model(**inputs, output_attentions=with_weights)
    finally:
        for h in handles:
            h.remove()
    out = seen["output"]
    t = model.config.model_type
    if t == "bloom":
        # BloomAttention adds the residual itself (dropout_add).
        out = out - seen["residual"]
    if t == "bert":
        # BertSelfAttention stops before the output projection, which
        # BertSelfOutput applies (then dropout, residual and LayerNorm).
        parent = dict(model.named_modules())[module_name.rsplit(".", 1)[0]]
        out = parent.output.dense(out)
    return seen["hidden_states"], out.detach(), seen.get("weights"), result


def metadata(model, layer, stack):
    return {"format": FORMAT, "version": VERSION,
            "config": json.dumps(model.config.to_dict()),
            "layer": str(layer), "stack": stack}


def record(model, layer, input_ids, attention_mask=None, position_ids=None,
           stack="encoder", extra_inputs=None):
    """The tensors and metadata of a reference file for one forward."""
    model.eval()
    name = attention_module_name(model, layer, stack)
    inputs = {"input_ids": input_ids}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if model.config.model_type == "t5":
        inputs["decoder_input_ids"] = input_ids
        if stack == "decoder":
            inputs["decoder_attention_mask"] = attention_mask
    inputs.update(extra_inputs or {})
    hidden, out, weights, _ = run_layer(model, name, inputs)
    n, length = input_ids.shape
    tensors = {"hidden_states": hidden, "output": out}
    if weights is not None:
        tensors["weights"] = weights
    tensors["attention_mask"] = (attention_mask if attention_mask is not None
                                 else torch.ones(n, length, dtype=torch.long))
    tensors["position_ids"] = (position_ids if position_ids is not None else
                               torch.arange(length).expand(n, length))
    tensors.update(layer_tensors(model, name, stack))
    return ({k: v.contiguous() for k, v in tensors.items()},
            metadata(model, layer, stack))


def main():
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory or hub name")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--stack", default="encoder", choices=["encoder", "decoder"],
                   help="T5 only: whose self-attention")
    p.add_argument("--text", default="The quick brown fox jumps over it.")
    p.add_argument("--out", required=True, help="the reference file to write")
    args = p.parse_args()

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModel.from_pretrained(
        args.model, attn_implementation="eager", dtype=torch.float32)
    enc = tok([args.text], return_tensors="pt")
    tensors, meta = record(model, args.layer, enc["input_ids"],
                           enc.get("attention_mask"), stack=args.stack)
    save_file(tensors, args.out, metadata=meta)
    print(f"wrote {args.out}: layer {args.layer}, "
          f"hidden_states {list(tensors['hidden_states'].shape)}")


if __name__ == "__main__":
    main()
