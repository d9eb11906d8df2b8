"""GPU check: greedy generate() with attn_implementation="dilgen" equals a loop of full forwards
(float32, one prompt and a left-padded batch), and the decode kernel ran."""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import dilgen.integrations.transformers  # noqa: F401
from dilgen.runtime import GeneratedAttention
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, pad_token_id=0)
cfg.dilgen_spec = {"segment_lengths": [64, 128, 256], "dilation_rates": [1, 2, 4]}
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="dilgen").cuda().eval()
calls = []
real = GeneratedAttention.decode
GeneratedAttention.decode = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
res = {}
for batch in (1, 4):
    ids = torch.randint(3, 256, (batch, 300), device="cuda")
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :40] = 0
        mask[3, :7] = 0
        ids[mask == 0] = 0
    calls.clear()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    n_decode = len(calls)
    x, m = ids.clone(), mask.clone()
    GeneratedAttention.decode = real
    with torch.no_grad():
        for _ in range(24):
            pos = (m.cumsum(-1) - 1).clamp_min(0)
            nxt = model(x, attention_mask=m, position_ids=pos).logits[:, -1].argmax(-1, keepdim=True)
            x, m = torch.cat([x, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    GeneratedAttention.decode = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    res[f"batch {batch}"] = {"equal": bool(torch.equal(out, x)), "decode_calls": n_decode,
                             "first_difference": None if torch.equal(out, x) else int((out != x).any(0).nonzero()[0])}
print(json.dumps(res))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_generate_check.json"), "w"))
