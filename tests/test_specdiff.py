"""The schema id of a shard's tensors, and the tensor-by-tensor account of ranks that
disagree (protocol/specdiff.py): pure functions over real manifests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorhub.manifest.manifest import Manifest, build_manifest
from tensorhub.model import SCHEMA_ID_BYTES, VersionKey, schema_id
from tensorhub.protocol.refs import Holding, announcement_bytes
from tensorhub.protocol.sharding import Sharding
from tensorhub.protocol.specdiff import RankSpecs, spec_differences

Arrays = dict[str, np.ndarray[Any, Any]]
TP4 = Sharding(0, 4, split={"w*": 0, "v": 1})


def full() -> Arrays:
    return {"w1": np.zeros((96, 40), np.float32), "w2": np.zeros((8, 3), np.int16),
            "v": np.zeros((5, 16), np.float32), "norm": np.zeros(40, np.float32)}


def part(arrays: Arrays, spec: Sharding) -> Arrays:
    return {k: np.ascontiguousarray(a[tuple(slice(x, y) for x, y in spec.box(k, a.shape))])
            for k, a in arrays.items()}


def manifest(arrays: Arrays, spec: Sharding = TP4) -> Manifest:
    items = list(arrays.items())
    return build_manifest(VersionKey("m", 1, spec.rank, spec.layout_id), items, 4096,
                          "blake3", spec.size, [spec.place(k, a.shape) for k, a in items])


def ranks(arrays: Arrays, spec: Sharding = TP4) -> list[Manifest]:
    return [manifest(part(arrays, spec.at(r)), spec.at(r)) for r in range(spec.size)]


def specs(ms: list[Manifest]) -> list[RankSpecs]:
    return [RankSpecs(m.shard, (f"t{m.shard}",), m.tensors) for m in ms]


# -- schema id ----------------------------------------------------------------------------


def test_every_rank_of_a_consistent_publish_has_one_schema_id() -> None:
    ms = ranks(full())
    assert len({m.manifest_id() for m in ms}) == 4  # each rank's manifest is its own
    assert len({m.schema_id() for m in ms}) == 1
    assert len(ms[0].schema_id()) == SCHEMA_ID_BYTES
    # what a whole publish of the same tensors lists: the same specs
    assert manifest(full(), Sharding()).schema_id() == ms[0].schema_id()
    # tensor order does not matter
    assert schema_id(reversed(ms[1].tensors)) == ms[1].schema_id()


@pytest.mark.parametrize("change", ["dtype", "split shape", "replicated shape",
                                    "missing", "extra"])
def test_any_spec_change_at_one_rank_changes_its_schema_id(change: str) -> None:
    good = ranks(full())
    local = part(full(), TP4.at(2))
    if change == "dtype":
        local["w1"] = local["w1"].astype(np.float64)
    elif change == "split shape":
        local["w1"] = np.zeros((24, 41), np.float32)  # its whole tensor is [96, 41]
    elif change == "replicated shape":
        local["norm"] = np.zeros(41, np.float32)
    elif change == "missing":
        del local["norm"]
    else:
        local["x"] = np.zeros(3, np.float32)
    odd = manifest(local, TP4.at(2))
    assert odd.schema_id() != good[0].schema_id()


def test_the_schema_id_is_under_the_publishers_signature() -> None:
    h = Holding("m", 1, b"i" * 16, "t0", 4, schema=b"s" * 16)
    assert announcement_bytes(h) != announcement_bytes(Holding("m", 1, b"i" * 16, "t0", 4,
                                                               schema=b"z" * 16))


# -- the account of a disagreement -----------------------------------------------------------


def test_ranks_that_agree_have_nothing_to_say() -> None:
    assert spec_differences(specs(ranks(full())), 4) == []
    whole = manifest(full(), Sharding())
    assert spec_differences([RankSpecs(0, ("a",), whole.tensors)], 1) == []


def test_another_dtype_names_the_tensor_and_both_sides() -> None:
    ms = ranks(full())
    local = part(full(), TP4.at(2))
    local["w1"] = local["w1"].astype(np.float64)
    ms[2] = manifest(local, TP4.at(2))
    assert spec_differences(specs(ms), 4) == [
        "tensor 'w1': rank 2 (peer t2) has float64 [96, 40], "
        "ranks 0, 1, 3 (peers t0, t1, t3) have float32 [96, 40]"]


def test_missing_and_extra_tensors_and_another_shape() -> None:
    ms = ranks(full())
    local = part(full(), TP4.at(3))
    local["x"] = np.zeros(3, np.float32)
    local["w2"] = np.zeros((3, 3), np.int16)  # whole [12, 3]
    del local["norm"]
    ms[3] = manifest(local, TP4.at(3))
    assert spec_differences(specs(ms), 4) == [
        "tensor 'norm' only at ranks 0, 1, 2 (peers t0, t1, t2), not at rank 3 (peer t3)",
        "tensor 'w2': rank 3 (peer t3) has int16 [12, 3], ranks 0, 1, 2 (peers t0, t1, "
        "t2) have int16 [8, 3]",
        "tensor 'x' only at rank 3 (peer t3), not at ranks 0, 1, 2 (peers t0, t1, t2)"]
    # several shapes, and ranks without it
    ms[2] = manifest({**part(full(), TP4.at(2)), "x": np.zeros(4, np.float32)}, TP4.at(2))
    assert spec_differences(specs(ms), 4)[-1] == (
        "tensor 'x': rank 2 (peer t2) has float32 [4], rank 3 (peer t3) has float32 [3], "
        "ranks 0, 1 (peers t0, t1) lack it")


def test_a_rank_that_splits_along_another_dim_or_into_other_parts() -> None:
    ms = ranks(full())
    by_dim1 = Sharding(1, 4, split={"w1": 1, "w2": 0, "v": 1})
    ms[1] = manifest(part(full(), by_dim1), by_dim1)
    (line,) = spec_differences(specs(ms), 4)
    assert line.startswith("tensor 'w1': the ranks' slices do not tile its [96, 40] "
                           "(overlapping): rank 0 (peer t0) [0:24, 0:40], "
                           "rank 1 (peer t1) [0:96, 10:20], ")
    uneven = Sharding(3, 4, split={"w*": 0, "v": 1}, parts={"w1": [30, 30, 30, 6]})
    ms = ranks(full())
    ms[3] = manifest(part(full(), uneven), uneven)
    assert spec_differences(specs(ms), 4) == [
        "tensor 'w1': the ranks' slices do not tile its [96, 40] (with gaps): "
        "rank 0 (peer t0) [0:24, 0:40], rank 1 (peer t1) [24:48, 0:40], "
        "rank 2 (peer t2) [48:72, 0:40], rank 3 (peer t3) [90:96, 0:40]"]
    # a rank that holds a split tensor whole
    ms = ranks(full())
    solo = Sharding(2, 4, split={"w*": 0})
    ms[2] = manifest(part(full(), solo), solo)
    assert spec_differences(specs(ms), 4) == [
        "tensor 'v': rank 2 (peer t2) has float32 [5, 16] whole, ranks 0, 1, 3 (peers t0, "
        "t1, t3) have float32 [5, 16] as a slice"]


def test_tiling_is_only_judged_with_every_rank_at_hand() -> None:
    ms = ranks(full())
    uneven = Sharding(3, 4, split={"w*": 0, "v": 1}, parts={"w1": [30, 30, 30, 6]})
    ms[3] = manifest(part(full(), uneven), uneven)
    assert spec_differences(specs(ms[1:]), 4) == []
    assert spec_differences(specs(ms), None) == []
