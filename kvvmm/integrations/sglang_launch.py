"""Run a module (SGLang's server) with kvvmm installed as its ``kv_vmm_backing``, in every process.

    python -m kvvmm.integrations.sglang_launch sglang.launch_server --model-path ... [args]

SGLang builds its KV pool in worker processes it starts with multiprocessing's ``spawn``; a
spawned child re-imports the parent's main module (as ``__mp_main__``) before it runs, so
:func:`~kvvmm.integrations.sglang.install` is called here at import, not under the main
guard: parent and children alike get the alias. The target runs with this module kept as
``__main__`` (``alter_sys=False``) for the same reason: spawn looks up ``__main__``'s name to
know what to re-import.
"""

from __future__ import annotations

import runpy
import sys

from kvvmm.integrations.sglang import install

install()


def main(argv: list[str]) -> None:
    """Run the module ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m kvvmm.integrations.sglang_launch MODULE [ARGS...]"
                         " (e.g. sglang.launch_server --model-path ...)")
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main(sys.argv[1:])
