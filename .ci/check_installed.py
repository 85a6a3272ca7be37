"""The installed wheel, as .ci/run's wheel section checks it: run by the fresh venv's Python with -I
(no checkout on the path), from a folder outside the checkout, whose path is the one argument.

Every module of kv_ops and ple_ops imports (an integration whose extra is absent must say what to
install), both load from the venv with their py.typed, the wheel installed nothing but kv_ops/ and
ple_ops/, README's Quickstart (its first python block) runs, and the doctor exits 0 (on CPU its
CUDA checks skip, which is not a failure).
"""

import importlib
import importlib.metadata
import pathlib
import pkgutil
import re
import subprocess
import sys

import kv_ops
import ple_ops

checkout = pathlib.Path(sys.argv[1]).resolve()
for package in (kv_ops, ple_ops):
    where = pathlib.Path(package.__file__).resolve().parent
    assert not where.is_relative_to(checkout), f"{package.__name__} loaded from the checkout: {where}"
    assert (where / "py.typed").is_file(), f"{where} has no py.typed"
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith(".__main__"):
            try:
                importlib.import_module(module.name)
            except ImportError as e:
                if not (module.name.startswith("kv_ops.integrations.") and "pip install" in str(e)):
                    raise
metadata = f"offload_ops-{kv_ops.__version__}.dist-info"
tops = {f.parts[0] for f in importlib.metadata.files("offload-ops")} - {metadata}
assert tops == {"kv_ops", "ple_ops"}, f"the wheel installed {sorted(tops)}"
print(f"check_installed: the wheel of offload-ops {kv_ops.__version__} installed {sorted(tops)}", file=sys.stderr)

readme = (checkout / "README.md").read_text()
section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
pathlib.Path("quickstart.py").write_text(re.search(r"^```python\n(.*?)^```$", section, re.S | re.M).group(1))
subprocess.run([sys.executable, "-I", "quickstart.py"], check=True)
subprocess.run([sys.executable, "-I", "-m", "kv_ops.tools.doctor"], check=True)
