"""Peak numbers of common lab and data-centre GPUs, looked up by the name a cluster file gives.

Each :class:`DeviceKind` holds

- ``memory``: the card's memory in bytes (nominal: a "24 GB" card is 24 GiB here; the driver shows a
  few hundred MiB less),
- ``flops``: peak *dense* FLOP/s by precision (``fp32``; ``fp16`` and ``bf16`` on tensor cores where
  the card has them, never the 2:4-sparsity figures datasheets print first). A precision the card does
  not run fast (bf16 before Ampere, fp16 on Pascal GeForce) is absent, so nothing plans for it,
- ``memory_bandwidth``: peak memory bandwidth in bytes/s,
- ``source``: the datasheet or whitepaper, the form factor and the accumulate type the numbers are for.

These are peaks at boost clock: no model reaches them, and the cost model applies an efficiency.
GeForce cards run fp16/bf16 tensor maths with fp32 accumulate (what PyTorch autocast uses) at half
their fp16-accumulate rate; their entries give that fp32-accumulate rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetfair.errors import ConfigError

GiB = 1 << 30
T = 1e12  # FLOP/s
GBs = 1e9  # bytes/s


@dataclass(frozen=True)
class DeviceKind:
    """One catalogue entry: a GPU's peak numbers and where they come from."""

    name: str
    memory: int
    flops: Mapping[str, float]
    memory_bandwidth: float
    source: str


_TURING = ("NVIDIA Turing GPU Architecture whitepaper, reference (not Founders Edition) boost clock; "
           "fp16 tensor with fp32 accumulate: https://images.nvidia.com/aem-dam/en-zz/Solutions/design-visualization/"
           "technologies/turing-architecture/NVIDIA-Turing-Architecture-Whitepaper.pdf")
_GA102 = ("NVIDIA Ampere GA102 GPU Architecture whitepaper; fp16/bf16 tensor with fp32 accumulate, dense: "
          "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet, SXM form; fp32 without TF32, fp16/bf16 tensor dense: "
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_V100 = ("NVIDIA Tesla V100 datasheet, SXM2 form; fp16 tensor with fp32 accumulate: "
         "https://images.nvidia.com/content/technologies/volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, {form} form; fp16/bf16 tensor dense (half the datasheet's "
         "sparsity figure; later editions list the H100 NVL in place of the PCIe card): "
         "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")


def _kind(name: str, memory_gib: int, bandwidth_gbs: float, source: str, **tflops: float) -> DeviceKind:
    return DeviceKind(name, memory_gib * GiB, {p: v * T for p, v in tflops.items()}, bandwidth_gbs * GBs, source)


_KINDS = [
    # GP102 runs fp16 at 1/64 of its fp32 rate: absent, so no plan picks it.
    _kind("GTX1080Ti", 11, 484, "NVIDIA GeForce GTX 1080 Ti specifications (boost clock, 3584 CUDA cores): "
          "https://www.nvidia.com/en-gb/geforce/graphics-cards/geforce-gtx-1080-ti/specifications/", fp32=11.3),
    # The PCIe card (the lab's usual P100): the SXM2 one peaks higher (10.6 / 21.2).
    _kind("P100-16GB", 16, 732, "NVIDIA Tesla P100 PCIe datasheet (16 GB); fp16 on CUDA cores, 2x fp32: "
          "https://images.nvidia.com/content/tesla/pdf/nvidia-tesla-p100-PCIe-datasheet.pdf", fp32=9.3, fp16=18.7),
    # SXM2 figures; a PCIe V100 peaks at 14 / 112.
    _kind("V100-16GB", 16, 900, _V100, fp32=15.7, fp16=125),
    _kind("V100-32GB", 32, 900, _V100, fp32=15.7, fp16=125),
    # 70 W card: under sustained load it clocks well below the boost clock these peaks assume.
    _kind("T4", 16, 320, "NVIDIA T4 Tensor Core GPU datasheet; fp16 tensor with fp32 accumulate (mixed precision): "
          "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
          fp32=8.1, fp16=65),
    # Reference clock, the conservative figure: the Founders Edition peaks at 14.2 / 56.9.
    _kind("RTX2080Ti", 11, 616, _TURING, fp32=13.4, fp16=53.8),
    _kind("RTX3090", 24, 936, _GA102 + " (GeForce RTX 3090)", fp32=35.6, fp16=71, bf16=71),
    _kind("RTX4090", 24, 1008, "NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090); fp16/bf16 tensor "
          "with fp32 accumulate, dense: https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
          "nvidia-ada-gpu-architecture.pdf", fp32=82.6, fp16=165.2, bf16=165.2),
    _kind("RTXA6000", 48, 768, _GA102 + " (NVIDIA RTX A6000; full-rate fp32 accumulate)",
          fp32=38.7, fp16=154.8, bf16=154.8),
    _kind("A10", 24, 600, "NVIDIA A10 Tensor Core GPU datasheet; fp16/bf16 tensor dense: "
          "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf",
          fp32=31.2, fp16=125, bf16=125),
    _kind("A40", 48, 696, "NVIDIA A40 datasheet; fp16/bf16 tensor dense: https://images.nvidia.com/content/Solutions/"
          "data-center/a40/nvidia-a40-datasheet.pdf", fp32=37.4, fp16=149.7, bf16=149.7),
    _kind("L4", 24, 300, "NVIDIA L4 Tensor Core GPU datasheet; fp16/bf16 tensor dense (half the sparsity figure): "
          "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet", fp32=30.3, fp16=121, bf16=121),
    _kind("L40S", 48, 864, "NVIDIA L40S GPU datasheet; fp16/bf16 tensor dense: "
          "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413", fp32=91.6, fp16=362.05, bf16=362.05),
    _kind("A100-40GB", 40, 1555, _A100 + " (40GB HBM2)", fp32=19.5, fp16=312, bf16=312),
    _kind("A100-80GB", 80, 2039, _A100 + " (80GB HBM2e; the PCIe card has 1,935 GB/s)", fp32=19.5, fp16=312, bf16=312),
    _kind("H100-PCIe", 80, 2000, _H100.format(form="PCIe (HBM2e)"), fp32=51, fp16=756.5, bf16=756.5),
    _kind("H100-SXM", 80, 3350, _H100.format(form="SXM (HBM3)"), fp32=67, fp16=989.5, bf16=989.5),
]

CATALOGUE: dict[str, DeviceKind] = {kind.name: kind for kind in _KINDS}


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c not in "-_ ")


def device_kind(name: str) -> DeviceKind:
    """The catalogue entry called ``name``, ignoring case, ``-``, ``_`` and spaces (``"a100_80gb"``)."""
    kind = next((kind for known, kind in CATALOGUE.items() if _key(known) == _key(name)), None)
    if kind is None:
        raise ConfigError(f"unknown device kind '{name}': the catalogue knows {', '.join(CATALOGUE)}; for another "
                          f'device give measured numbers, e.g. {{kind = "measured", memory = "24G", fp32 = "35T"}}')
    return kind
