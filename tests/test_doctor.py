import subprocess
import sys


def test_doctor_reports_the_machine():
    out = subprocess.run([sys.executable, "-m", "fastdata", "doctor"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for key in ("torch", "CUDA devices", "PIL", "DALI", "usable cores", "backends"):
        assert key in out, out
    assert "torch" in out.split("backends", 1)[1]


def test_pil_info_detects_the_installed_flavour():
    import PIL

    from fastdata.doctor import pil_info

    info = pil_info()
    assert info["version"] == PIL.__version__
    assert info["simd"] == (".post" in PIL.__version__)
