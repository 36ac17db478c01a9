"""transformers' side of tests/examples/gpt_hf_test.cpp (GPT-2 in Hugging Face's layout).

  hf_gpt2.py logits DIR TOKENS OUT        load DIR with GPT2LMHeadModel.from_pretrained, write
                                          the logits of TOKENS (a safetensors file holding
                                          "tokens" [B, T] int64) to OUT as "logits"
  hf_gpt2.py make DIR CONFIG TOKENS OUT   a randomly initialised GPT2LMHeadModel of CONFIG (a
                                          JSON file of GPT2Config's fields), saved into DIR in
                                          several shards, and its logits as above
  hf_gpt2.py check                       exits 0 when the imports succeed

Exits 3 when transformers or safetensors cannot be imported (the test then skips).
"""
import json
import sys

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
except ImportError as e:  # the test skips, naming what is missing
    print(f"cannot import: {e}", file=sys.stderr)
    sys.exit(3)


def logits_of(model, tokens_file, out):
    model.eval()
    tokens = load_file(tokens_file)["tokens"]
    with torch.no_grad():
        logits = model(tokens).logits
    save_file({"logits": logits.contiguous().float()}, out)


def main():
    hf_logging.set_verbosity_error()
    mode = sys.argv[1]
    if mode == "check":  # the imports above succeeded
        return
    if mode == "logits":
        directory, tokens, out = sys.argv[2:5]
        model = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager")
        logits_of(model, tokens, out)
    elif mode == "make":
        directory, config, tokens, out = sys.argv[2:6]
        torch.manual_seed(7)
        with open(config) as f:
            fields = json.load(f)
        model = GPT2LMHeadModel(GPT2Config(**fields))
        # several shards at any width: 20 square matrices' worth each, at least 200 KB
        shard_kb = max(200, fields["n_embd"] ** 2 * 20 * 4 // 1000)
        model.save_pretrained(directory, max_shard_size=f"{shard_kb}KB", safe_serialization=True)
        logits_of(model, tokens, out)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
