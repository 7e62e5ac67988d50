"""torch backend: PIL recipe against torchvision's, reduced-scale decoding, batched workers."""
import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder
from fastdata.transforms import load_photo


def torchvision_eval(paths, mean, std):
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    return torch.stack([tf(Image.open(p).convert("RGB")) for p in paths])


def test_eval_recipe_matches_torchvision(photo_folder):
    """Resize-shorter-256 + center-crop-224 done as one PIL resize of the crop box (with Image.draft's
    reduced-scale decode) agrees with torchvision's two-step Resize + CenterCrop of the full decode.
    Tolerance: the DCT-domain downscale and the single resampling differ from decode-then-resize
    by a few grey levels (mean |diff| under 0.03 in normalized units ≈ 2/255 after the 1/0.225 std)."""
    src = ImageFolder(photo_folder)
    x = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, device="cpu",
                                             num_workers=0)])
    ref = torchvision_eval(src.paths, src.mean, src.std)
    diff = (x - ref).abs()
    assert diff.mean() < 0.03, diff.mean()
    assert torch.quantile(diff.flatten()[::97], 0.99) < 0.2


def test_draft_decodes_at_reduced_scale_without_changing_the_result_much(photo_folder, monkeypatch):
    path = ImageFolder(photo_folder).paths[0]
    aug = Augmentation(crop="center", size=56, resize=64)   # a small output lets draft use 1/4 scale
    from PIL import JpegImagePlugin

    calls = []
    orig = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        out = orig(self, mode, size)
        calls.append(out)
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    fast = load_photo(path, aug, np.random.default_rng(0)).astype(np.float32)
    assert calls and calls[0] is not None, "draft must be asked to shrink the JPEG decode"
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, mode, size: None)
    slow = load_photo(path, aug, np.random.default_rng(0)).astype(np.float32)
    assert fast.shape == slow.shape == (56, 56, 3)
    assert np.abs(fast - slow).mean() < 3.0


def test_random_resized_crop_varies_and_flips(photo_folder):
    src = ImageFolder(photo_folder)
    loader = make_loader(src, "torch", batch_size=6, device="cpu", num_workers=2, seed=0)
    a = torch.cat([x for x, _ in loader])
    b = torch.cat([x for x, _ in loader])
    assert a.shape == (18, 3, 224, 224)
    assert (a - b).abs().mean() > 0.1, "two epochs must crop differently"
    flip = Augmentation(crop="center", size=224, resize=256, hflip=1.0)
    flipped = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, augment=flip,
                                                   device="cpu", num_workers=0)])
    plain = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, device="cpu",
                                                 num_workers=0)])
    torch.testing.assert_close(flipped, plain.flip(3))


def test_photos_without_a_resizing_crop_are_refused(photo_folder):
    with pytest.raises(ValueError, match="needs a crop that fixes the output size"):
        make_loader(ImageFolder(photo_folder), "torch", batch_size=6, augment=Augmentation.none(),
                    device="cpu")
