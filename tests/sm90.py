"""Our kernels compiled for an H100/H200 (sm_90) on any machine, and the list of them.

Triton's own LLVM and ptxas build the PTX, in a child process without ``TRITON_INTERPRET``: under
it, ``@jit`` gives interpreted functions, which neither compile nor are ``JITFunction``s to find.
"""

import importlib
import json
import os
import pkgutil
import subprocess
import sys

# The pointers of each kernel that are not bytes (``*u8``); every other argument is a runtime int64.
POINTERS = {
    "_block_copy_kernel": {"table_ptr": "*i64", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64", "error_ptr": "*i64"},
    "_prefix_copy_kernel": {
        name: "*i64" for name in ("length_ptr", "start_ptr", "out_length_ptr", "out_saved_ptr", "saved_ptr", "go_ptr")
    },
    "_claim_kernel": {"holder_ptr": "*i64", "go_ptr": "*i64"},
    "_wait_landed_kernel": {"flags_ptr": "*i32", "error_ptr": "*i64"},
    "_wait_kernel": {"flag_ptr": "*i32", "waiting_ptr": "*i32"},
    "_copy_kernel": {},
    "_release_kernel": {"flag_ptr": "*i32", "waiting_ptr": "*i32"},
}


def compiled(module: str, name: str, constexprs: dict, warps: int, aligned: bool = False) -> dict:
    """``{"ptx": ..., "shared": bytes of shared memory}`` of kernel ``name`` of ``module`` at these
    constexprs and warps; ``aligned``: every pointer 16-byte aligned."""
    return _child(json.dumps([module, name, constexprs, warps, aligned]))


def kernels() -> list[str]:
    """The ``@triton.jit`` functions named ``*_kernel`` in every module of kv_ops and ple_ops."""
    return _child("--list")


def _child(arg: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # -P: not this file's folder first on sys.path, where tests/kv_ops would stand in for kv_ops.
    out = subprocess.run([sys.executable, "-P", __file__, arg], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _compile(module: str, name: str, constexprs: dict, warps: int, aligned: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = getattr(importlib.import_module(module), name)
    pointers = POINTERS[name]
    signature = {
        arg: "constexpr" if arg in constexprs else pointers.get(arg, "*u8" if arg.endswith("_ptr") else "i64")
        for arg in kernel.arg_names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if aligned and a.endswith("_ptr")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    out = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return {"ptx": out.asm["ptx"], "shared": out.metadata.shared}


def _kernels() -> list[str]:
    from triton.runtime.jit import JITFunction

    found = set()
    for package in ("kv_ops", "ple_ops"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            if info.name.endswith(".__main__"):  # a command, run on import
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an integration whose client (vLLM, transformers) is absent
                continue
            found |= {n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return sorted(found)


if __name__ == "__main__":
    print(json.dumps(_kernels() if sys.argv[1] == "--list" else _compile(*json.loads(sys.argv[1]))))
