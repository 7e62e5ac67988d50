import subprocess
import sys


def test_doctor_reports_the_machine():
    out = subprocess.run([sys.executable, "-m", "fastdata", "doctor"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for key in ("torch", "CUDA devices", "PIL", "DALI", "usable cores", "region decode", "backends"):
        assert key in out, out
    assert "torch" in out.split("backends", 1)[1]


def test_pil_info_detects_the_installed_flavour():
    import PIL

    from fastdata.doctor import pil_info

    info = pil_info()
    assert info["version"] == PIL.__version__
    assert info["simd"] == (".post" in PIL.__version__)


def test_a_pillow_built_without_an_image_library_is_named_with_its_package(monkeypatch, capsys):
    """install.sh builds Pillow-SIMD from source, which links only the image libraries whose headers the
    machine has (a Pillow wheel bundles them all): without libwebp's, no .webp file can be read. doctor
    says which formats are lost and what to install."""
    from PIL import features

    from fastdata import doctor

    monkeypatch.setattr(features, "check", lambda name: name not in ("webp", "libtiff"))
    assert doctor.pil_cannot_read() == ["WebP (libwebp-dev)", "compressed TIFF (libtiff-dev)"]
    monkeypatch.setattr(doctor, "pil_info", lambda: {"version": "9.5.0.post2", "simd": True, "avx2": True,
                                                     "cannot_read": doctor.pil_cannot_read()})
    doctor.main()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("PIL"))
    assert "Pillow-SIMD (AVX2); built without WebP (libwebp-dev), compressed TIFF (libtiff-dev)" in line
    assert "./install.sh again" in line
    monkeypatch.setattr(features, "check", lambda name: True)
    assert doctor.pil_cannot_read() == []


def test_plain_pillow_and_missing_dali_hints_serve_a_pip_install_too(monkeypatch, capsys):
    """Both hints named only what a clone has (./install.sh) or a bare wheel: someone who ran
    ``pip install fastdata`` gets the pip commands (found by the dependency-matrix QA pass)."""
    from fastdata import doctor

    monkeypatch.setattr(doctor, "nvidia_smi", lambda: None)
    monkeypatch.setattr(doctor, "pil_info", lambda: {"version": "11.3.0", "simd": False, "avx2": None})
    monkeypatch.setattr(doctor, "dali_info", lambda: {"version": None, "gpu": False, "note": "-"})
    doctor.main()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("PIL"))
    assert "pip uninstall -y pillow && pip install --no-deps pillow-simd" in line and "./install.sh" in line
    monkeypatch.undo()
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(
        ImportError("no DALI")) if name.startswith("nvidia.dali") else real(name, *a, **k))
    assert "pip install 'fastdata[dali]'" in doctor.dali_info()["note"]


# ------------------------------------------------------------------ the GPU verdict (issue 9.13)
from fastdata import doctor
from fastdata.doctor import gpu_verdict, parse_nvidia_smi

H100_550 = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 550.54.15\nNVIDIA H100 80GB HBM3, 550.54.15\n")
H100_580 = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 580.65.06\n")


def test_nvidia_smi_output_parsed():
    assert H100_550 == {"driver": "550.54.15", "gpus": ["NVIDIA H100 80GB HBM3"] * 2}
    assert parse_nvidia_smi("") is None
    assert parse_nvidia_smi("No devices were found\n") is None


def test_driver_too_old_for_torchs_cuda_is_named():
    ok, why = gpu_verdict(H100_550, "13.0", usable=0)
    assert not ok
    assert "550.54.15 is too old" in why and "CUDA 13.0" in why and ">= 580" in why
    assert "is_available() is False" in why and "2 GPU(s)" in why


def test_recent_driver_verdicts():
    assert gpu_verdict(H100_580, "13.0", usable=1) == (True, "1 GPU(s) usable by torch (CUDA 13.0)")
    ok, why = gpu_verdict(H100_580, "13.0", usable=0)  # driver fine, GPU still unusable: say what else
    assert not ok and "too old" not in why and "CUDA_VISIBLE_DEVICES" in why
    ok, why = gpu_verdict(H100_550, "12.8", usable=0)  # 550 runs CUDA 12: not the driver's fault
    assert not ok and "too old" not in why


def test_no_nvidia_smi_means_no_gpu():
    ok, why = gpu_verdict(None, "13.0", usable=0)
    assert ok and "no NVIDIA GPU" in why


def test_cpu_only_torch_build_on_a_gpu_machine():
    ok, why = gpu_verdict(H100_580, None, usable=0)
    assert not ok and "CPU-only build" in why


def test_doctor_prints_the_old_driver_problem_and_fails(monkeypatch, capsys):
    # nvidia-smi answering like a 550 driver, on a machine where torch sees no GPU (the CPU here).
    import torch

    from fastdata import doctor

    monkeypatch.setattr(doctor, "nvidia_smi", lambda: H100_550)
    monkeypatch.setattr(doctor, "pil_info", lambda: {"version": "x", "simd": True, "avx2": True})
    monkeypatch.setattr(doctor, "dali_info", lambda: {"version": None, "gpu": False, "note": "-"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "550.54.15 (2 GPU(s): NVIDIA H100 80GB HBM3" in out
    assert "PROBLEM" in out and "too old for torch built for CUDA 13.0" in out and ">= 580" in out
    monkeypatch.setattr(doctor, "nvidia_smi", lambda: None)
    assert doctor.main() == 0
    assert "ok: no NVIDIA GPU" in capsys.readouterr().out


def test_dali_wheels_cuda_build_and_its_driver_need():
    from importlib import metadata

    from fastdata.doctor import _dali_build, dali_cuda_major

    try:
        metadata.version("nvidia-dali-cuda120")
    except metadata.PackageNotFoundError:
        return  # another DALI build (or none): the name table is checked below
    assert dali_cuda_major() == 12
    assert _dali_build({"cuda_major": 12}) == " (CUDA 12 build, needs driver >= 525.60.13)"
    assert _dali_build({"cuda_major": None}) == ""


def test_doctor_prints_each_rows_install_hint_and_autos_order(monkeypatch, capsys):
    from fastdata import doctor, registry

    monkeypatch.setattr(doctor, "nvidia_smi", lambda: None)
    monkeypatch.setattr(doctor, "pil_info", lambda: {"version": "x", "simd": True, "avx2": True})
    monkeypatch.setattr(doctor, "dali_info", lambda: {"version": None, "gpu": False, "note": "-"})
    registry.register("ghost", "ghost_pkg.loader:GhostLoader", needs="ghost_pkg", install="pip install ghost",
                      order=15, devices=("cuda",))
    try:
        assert doctor.main() == 0
    finally:
        registry.unregister("ghost")
    out = capsys.readouterr().out
    assert "not installed (ghost_pkg does not import): pip install ghost" in out
    assert "auto on cpu    memory > torch" in out
    assert "memory > (ghost: not installed) > " in out.split("auto on cuda", 1)[1]


def test_doctor_says_whether_crops_decode_only_their_window(monkeypatch):
    import fastdata.images.region as region

    monkeypatch.setattr(region, "region_decoder_status",
                        lambda: "unavailable: nvImageCodec is not installed (x); pip install y")
    assert doctor._region_status().endswith("crops decode the whole JPEG (Image.draft)")
    monkeypatch.setattr(region, "region_decoder_status", lambda: "available: nvImageCodec 0.9.0")
    monkeypatch.setattr(region, "region_available", lambda: True)
    assert doctor._region_status() == "available: nvImageCodec 0.9.0"
    monkeypatch.setenv("FASTDATA_REGION_DECODE", "0")
    assert doctor._region_status().startswith("off (FASTDATA_REGION_DECODE=0)")
