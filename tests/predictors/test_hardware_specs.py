"""The bundled accelerator specs added for issue 19 (GB200 / GB300 NVL72, H20, MI300X / MI325X / MI355X; B200
checked): they load, read as dense per-device figures, have a scale-up domain, and each names its source."""

from pathlib import Path

import pytest

from predictors.hardware import HARDWARE_DIR, bundled, find, identify

SOURCES = Path(__file__).resolve().parents[2] / "predictors" / "sources" / "hardware.md"


@pytest.mark.parametrize("name, bf16, fp8, memory_gb, scale_up, domain, scale_out, per_node", [
    # NVIDIA's rack figures with sparsity (GB200 and GB300 NVL72: 360 PF BF16, 720 PF FP8) over 72 GPUs, halved
    ("GB200", 360e3 / 72 / 2, 720e3 / 72 / 2, 186, 900, 72, 50, 4),
    ("GB300", 360e3 / 72 / 2, 720e3 / 72 / 2, 279, 900, 72, 100, 4),
    ("B200", 2250, 4500, 180, 900, 8, 50, 8),
    ("H20", 148, 296, 96, 450, 8, 50, 8),
    ("MI300X", 1307.4, 2614.9, 192, 448, 8, 50, 8),
    ("MI325X", 1307.4, 2614.9, 256, 448, 8, 50, 8),
    ("MI355X", 2516.6, 5033.2, 288, 537.6, 8, 50, 8),
])
def test_added_specs_are_dense_per_device_figures(name, bf16, fp8, memory_gb, scale_up, domain, scale_out, per_node):
    hw = find(name)
    assert hw.peak_flops("bf16") == pytest.approx(bf16 * 1e12) and hw.peak_flops("fp8") == pytest.approx(fp8 * 1e12)
    assert (hw.memory_gb, hw.scale_up_gbs, hw.domain, hw.scale_out_gbs, hw.devices_per_node) == \
        (memory_gb, scale_up, domain, scale_out, per_node)


def test_an_nvl72_rack_is_one_scale_up_domain_beyond_its_trays():
    gb200 = find("GB200")
    assert gb200.devices_per_node == 4 and gb200.domain == 72
    assert gb200.link_gbs(72) == gb200.scale_up_gbs and gb200.link_gbs(144) == gb200.scale_out_gbs
    assert find("B200").link_gbs(16) == find("B200").scale_out_gbs


def test_driver_names_find_their_specs():
    for reported, name in (("NVIDIA GB200", "GB200"), ("NVIDIA GB300", "GB300"), ("NVIDIA B200", "B200"),
                           ("NVIDIA H20", "H20"), ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200"),
                           ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI325X", "MI325X"),
                           ("AMD Instinct MI355X", "MI355X")):
        assert identify({"name": reported, "device_type": "cuda"}).name == name, reported


def test_every_bundled_spec_names_its_source_and_the_added_ones_have_a_row_in_hardware_md():
    table = SOURCES.read_text()
    assert len(bundled()) == len(list(HARDWARE_DIR.glob("*.yaml")))
    assert all(hw.source.strip() for hw in bundled().values())
    for name in ("GB200", "GB300", "B200", "H20", "MI300X", "MI325X", "MI355X"):
        assert f"\n| {name} " in table, name
