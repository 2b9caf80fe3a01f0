"""Where apply_qk's wall time goes on the GPU host: each layer of the call, timed alone.

    python3 -m bench.apply_profile

Per call (median of 5 batches of 2000 calls, one sync per batch), T=64, Hq=32, Hk=8,
D=128, bf16: the Triton C launcher alone, the bound launch (pointer checks + launcher),
``RopeManager.apply_qk``, and FlashInfer's in-place call when installed.
"""

import torch

import jaxrope as jr
from bench.bridge_profile import per_call_us
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext


def main():
    rope = jr.RopeConfig(head_dim=128, theta=5e5, max_position=1 << 20)
    mgr = RopeManager(PositionConfig(rope=rope), "cuda", max_seq_len=1 << 20)
    mgr.ingest_request("r")
    mgr.plan(PositionStep((Segment("r", "text", 64),)), StepContext(("r",)))
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = mgr.pos_ids("text")
    mgr.apply_qk(q, k, "text")
    bound = mgr.launcher.bind(q, k, rope)
    launch = mgr.launcher._launch_for(q, k, rope, None)
    qp, kp, pp = q.data_ptr(), k.data_ptr(), pos.data_ptr()
    device = q.device

    def timed(fn):
        return per_call_us(fn, device, calls=2000, warmup=50)

    rows = {"launcher only (C launch)": timed(lambda: launch(pp, qp, kp)),
            "bound (ptr checks + launch)": timed(lambda: bound(q, k, pos)),
            "apply_qk": timed(lambda: mgr.apply_qk(q, k, "text")),
            "torch q.mul_(1.0)": timed(lambda: q.mul_(1.0))}
    try:
        from flashinfer import rope as fi
        rows["flashinfer apply_rope_pos_ids_inplace"] = timed(
            lambda: fi.apply_rope_pos_ids_inplace(q, k, pos, rotary_dim=128, interleave=False,
                                                  rope_theta=5e5))
    except ImportError as e:
        print("no flashinfer:", e)
    for name, us in rows.items():
        print(f"{name:40s} {us:7.2f} us")


if __name__ == "__main__":
    main()
