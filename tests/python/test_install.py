"""`cmake --install` into a temporary prefix, then `import dsv4` from there in a fresh interpreter
(ctest passes the build directory and the package's install directory)."""
import os
import subprocess
import sys

import pytest


def test_import_after_install(tmp_path):
    build = os.environ.get("DSV4_BUILD_DIR")
    package_dir = os.environ.get("DSV4_PYTHON_INSTALL_DIR")
    if not build or not package_dir:
        pytest.skip("run through ctest (DSV4_BUILD_DIR, DSV4_PYTHON_INSTALL_DIR)")
    subprocess.run(["cmake", "--install", build, "--prefix", str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "include" / "dsv4" / "dsv4.h").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / package_dir)
    code = ("import dsv4, numpy as np; c = dsv4.Config.preset('tiny-v4.1'); "
            "e = dsv4.Engine(c, dsv4.Weights.random(c), max_sequences=1, max_context=64, max_tokens_per_step=8); "
            "print(dsv4.__file__, len(e.step([(e.add_sequence(), 2)], np.ones((2, c.hidden_size), np.float32))))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True, capture_output=True,
                         text=True).stdout
    assert out.startswith(str(tmp_path)) and out.split()[-1] == str(c_layers(env, tmp_path))


def c_layers(env, cwd):
    code = "import dsv4; print(dsv4.Config.preset('tiny-v4.1').num_layers)"
    return int(subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True, capture_output=True,
                              text=True).stdout)
