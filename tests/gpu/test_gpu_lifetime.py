"""A tensor that outlives close() must not abort the process (SGLang's arena aborts at exit
with "invalid device pointer"). Each case runs in a spawned interpreter, so a crash cannot
poison this session."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=env)


def test_a_tensor_that_outlives_close_does_not_abort_the_process() -> None:
    proc = run("""
        import torch, kvvmm
        from kvvmm.driver.cuda import CudaDriver
        torch.empty(1, device="cuda")
        drv = CudaDriver()
        descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128,
                                      reserved_tokens=100_000, page_size=16, dtype="bfloat16")
        owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                                    reserved_tokens=100_000, descs=descs)
        owner.finalize(50_000)
        keep = owner.tensors[1]
        owner.close()
        keep[:10].fill_(1.0)           # still backed: close waited for it
        torch.cuda.synchronize()
        assert float(keep[:10].float().sum()) == 10 * 8 * 128
        print("ok", flush=True)
        # exit with `keep` alive: interpreter teardown frees it, then the arena
    """)
    assert "ok" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "invalid device pointer" not in proc.stderr


def test_an_owner_never_closed_does_not_abort_at_exit() -> None:
    proc = run("""
        import torch, kvvmm
        from kvvmm.driver.cuda import CudaDriver
        torch.empty(1, device="cuda")
        descs = kvvmm.mha_token_major(layers=1, kv_heads=8, head_dim=128,
                                      reserved_tokens=100_000, page_size=16, dtype="bfloat16")
        owner = kvvmm.KvBufferOwner(driver=CudaDriver(), dtype="bfloat16", page_size=16,
                                    reserved_tokens=100_000, descs=descs)
        owner.finalize(10_000)
        owner.tensors[0][:5].fill_(2.0)
        torch.cuda.synchronize()
        print("ok", flush=True)
    """)
    assert "ok" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
