# CPU dev check (gloo, fp32) of the megatron engine against the torch backend on `tiny`: logprobs, grads, one
# AdamW step, tenant isolation with spills, training-state round trip. PYTHONPATH=<megatron-core>:. python this.
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if not torch.cuda.is_available(): torch.cuda.current_device = lambda: "cpu"
from trainer_svc.backends.megatron.model import init_parallel

init_parallel(int(os.environ.get("WORLD_SIZE","1")))
from megatron.core import tensor_parallel

tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
import importlib.util

spec_ = importlib.util.spec_from_file_location("tm", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu", "test_megatron.py"))
tm = importlib.util.module_from_spec(spec_)
# bypass skip marks: call functions directly
torch.cuda.is_available = lambda: False
spec_.loader.exec_module(tm)
from loraplane.lora import LoraSpec
from loraplane.models import load_base_model
from trainer_svc.backends.torch_backend import TorchBackend
from trainer_svc.optimizer import AdamHyper

base32 = load_base_model("tiny", device="cpu", dtype=torch.float32)
spec = LoraSpec.create(8, 16.0, [], seed=5)
params = tm.random_adapter(base32, spec, seed=12)
data = tm.datums(base32.vocab_size, [48, 31], seed=4, with_weights=True)
hyper = AdamHyper(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
mg = tm.engine_for(base32, torch.float32)
mg_state = tm.make_state("a", spec, params, "cpu")
lpm,_ = tm.logprobs_of(mg, mg_state, data, backward=True)
(mg_grads,) = mg.driver.call("gather", {"name": "a", "rows": [1]})
mg_out = mg.optim_step(mg_state, hyper)
mg_after = mg.export_params(mg_state)
tc = TorchBackend(load_base_model("tiny", device="cpu", dtype=torch.float32))
tc_state = tm.make_state("a", spec, params, "cpu")
lpt,_ = tm.logprobs_of(tc, tc_state, data, backward=True)
tc_grads = {k: v.grad.detach().cpu().clone() for k, v in tc_state.params.items()}
tc_out = tc.optim_step(tc_state, hyper)
tc_after = {k: v.detach().cpu() for k, v in tc_state.params.items()}
keys = list(params)
print("lp", (tm.flat(lpm)-tm.flat(lpt)).abs().max().item())
g_mg, g_tc = tm.flat(mg_grads[k] for k in keys), tm.flat(tc_grads[k] for k in keys)
print("grad_rel", ((g_mg - g_tc).norm() / g_tc.norm()).item(), mg_out, tc_out)
d_mg = tm.flat(mg_after[k] - params[k] for k in keys); d_tc = tm.flat(tc_after[k] - params[k] for k in keys)
print("update_rel", ((d_mg - d_tc).norm() / d_tc.norm()).item())
tm.test_isolation_interleaved_equals_alone()
# save/load state roundtrip
p, m, v, step = mg.export_training_state(mg_state)
st2 = tm.make_state("b", spec, params, "cpu")
mg.load_training_state(st2, p, m, v, step)
p2, m2, v2, s2 = mg.export_training_state(st2)
print("state roundtrip", all(torch.equal(p[k], p2[k]) and torch.equal(m[k], m2[k]) and torch.equal(v[k], v2[k]) for k in p), step, s2)
