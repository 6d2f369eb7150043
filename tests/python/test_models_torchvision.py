"""Strobe's resnet and vit against torchvision on CPU: parameter counts, and the same outputs with
torchvision's weights copied in. Each reference (weights renamed to Strobe's names, an input, the
expected eval output) goes into a TorchScript archive that build/bin/strobe_model_check loads.
Exit 77 (skip) without torchvision or without the checker binary."""
import json, os, subprocess, sys, tempfile

try:
    import torch
    import torchvision
    from torchvision.models import resnet18, resnet34, resnet50, vit_l_16
    from torchvision.models.vision_transformer import VisionTransformer
except ImportError as e:
    print(f"skip: {e}")
    sys.exit(77)
from typing import Dict

BUILD = os.environ.get("STROBE_BUILD_DIR", "build")
CHECK = os.path.join(BUILD, "bin", "strobe_model_check")
if not os.path.exists(CHECK):
    print(f"skip: {CHECK} not built (add_subdirectory(models/tools))")
    sys.exit(77)


class Reference(torch.nn.Module):
    def __init__(self, weights: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        super().__init__()
        self.weights: Dict[str, torch.Tensor] = weights
        self.input = x
        self.expected = y

    def forward(self) -> torch.Tensor:
        return self.input


def randomize(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):  # non-trivial statistics so eval-mode BN is exercised
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
        for name, p in model.named_parameters():
            if "head" in name and p.abs().sum() == 0:  # torchvision zero-inits the ViT head
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def vit_name(n: str) -> str:
    n = n.replace("conv_proj.", "patch_embed.").replace("class_token", "cls_token")
    n = n.replace("encoder.pos_embedding", "pos_embed").replace("encoder.ln.", "norm.").replace("heads.head.", "head.")
    n = n.replace("encoder.layers.encoder_layer_", "blocks.")
    n = n.replace(".ln_1.", ".norm1.").replace(".ln_2.", ".norm2.")
    n = n.replace(".self_attention.in_proj_weight", ".qkv.weight").replace(".self_attention.in_proj_bias", ".qkv.bias")
    n = n.replace(".self_attention.out_proj.", ".proj.").replace(".mlp.0.", ".fc1.").replace(".mlp.3.", ".fc2.")
    return n


def check(label, model_yaml, model, x, rename=lambda n: n):
    model = randomize(model)
    with torch.no_grad():
        y = model(x)
    weights = {rename(k): v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ref.pt")
        torch.jit.script(Reference(weights, x, y)).save(path)
        proc = subprocess.run([CHECK, model_yaml, path], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"FAIL {label}: checker exit {proc.returncode}\n{proc.stderr}")
        return False
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    tv_count = sum(p.numel() for p in model.parameters())
    tol = 1e-4 * max(1.0, res["max_abs_expected"])
    ok = res["parameters"] == tv_count and res["max_abs_diff"] <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {label}: params strobe {res['parameters']:,} torchvision {tv_count:,}; "
          f"max |diff| {res['max_abs_diff']:.3g} (tol {tol:.3g})")
    return ok


def main():
    torch.manual_seed(0)
    ok = True
    ok &= check("resnet18 1000 classes", "{name: resnet, depth: 18, num_classes: 1000}", resnet18(), torch.randn(1, 3, 64, 64))
    ok &= check("resnet50 20 classes", "{name: resnet, depth: 50, num_classes: 20}", resnet50(num_classes=20), torch.randn(1, 3, 64, 64))
    r34 = resnet34(num_classes=10)
    r34.conv1 = torch.nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    ok &= check("resnet34 in_channels 1", "{name: resnet, depth: 34, num_classes: 10, in_channels: 1}", r34, torch.randn(2, 1, 28, 28))
    small_vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=256, num_classes=10)
    ok &= check("vit (torchvision VisionTransformer, 2 layers)",
                "{name: vit, img_size: 32, patch_size: 8, embed_dim: 64, depth: 2, num_heads: 4, num_classes: 10, class_token: true, global_pool: token}",
                small_vit, torch.randn(2, 3, 32, 32), vit_name)
    # vit_l_16 at full size: count on the meta device (no memory); Strobe's count of that config is
    # checked in C++ (ViT.L16ParameterCountFormulaEqualsTorchvisionsVitL16).
    with torch.device("meta"):
        count = sum(p.numel() for p in vit_l_16().parameters())
    print(f"{'ok  ' if count == 304326632 else 'FAIL'} torchvision vit_l_16 has {count:,} parameters (expected 304,326,632)")
    ok &= count == 304326632
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
