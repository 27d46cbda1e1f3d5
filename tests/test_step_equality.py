"""benchmarks/fidelity/step_equality.py's comparison without the authors' code: our step against a record of our own
step reads equal to the bit, a perturbed weight shows in the groups it reaches, their names and layouts map onto ours,
and the BN order puts the same images in each group."""
import copy
import os
import sys

import torch

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks", "fidelity"))
import step_equality as se  # noqa: E402

# a small head and queue, BN split in 2 (a batch of 8 in chunks of 4)
SMALL = [{"512": "32", "128": "16", "4096": "64", "8": "2"}.get(f, f) for f in se.OURS_FLAGS]


def test_our_step_against_its_own_record_is_equal_and_a_perturbed_weight_shows():
    _, training = se.our_training(SMALL, batch=8)
    feed = se.inputs(2, 8, size=16)
    reference = se.record_ours(training, feed, splits=2)
    same = se.compare(reference, se.our_steps(training, reference, feed, splits=2))
    assert all(d["all"] == 0 for d in same.values()), same
    perturbed = copy.deepcopy(reference)
    for name in ("encoder.layer1.0.conv1.weight", "momentum_encoder.layer1.0.conv1.weight"):  # both branches
        perturbed["steps"][1]["before"]["state"][name][0, 0, 0, 0] += 1e-2
    moved = se.compare(reference, se.our_steps(training, perturbed, feed, splits=2))
    assert all(d["first"] == 0 for d in moved.values()), moved  # step 1 starts from the record's state
    for group in ("loss", "gradients", "weights (SGD's change)", "EMA (its change)", "queue (its change)",
                  "BN statistics (their change)", "SGD buffers"):
        assert moved[group]["all"] > 1e-6, (group, moved)


def test_their_names_and_layouts_map_onto_ours():
    _, training = se.our_training(SMALL, batch=8)
    ours = training.model.state_dict()
    back = {v: k for k, v in se.PREFIXES.items()}
    theirs = {}
    for name, t in ours.items():
        prefix = next((p for p in back if name.startswith(p)), "")
        theirs[back[prefix] + name[len(prefix):] if prefix else name] = (
            t.t() if name == "queue" else t.reshape(1) if name == "queue_ptr" else t)
    structure = [(k, list(v.shape)) for k, v in theirs.items()]
    pairs, only_theirs, only_ours = se.mapping(structure, ours)
    assert len(pairs) == len(ours) - len(only_ours) and set(pairs.values()) | set(only_ours) == set(ours)
    assert all(n.endswith("num_batches_tracked") for n in only_theirs + only_ours)
    record = dict(structure=structure, steps=[dict(before=dict(state=theirs, sgd={}), after=dict(state=theirs, sgd={}),
                                                   grads={})])
    mapped = se.in_our_names(record, ours)["steps"][0]["before"]["state"]
    assert all(torch.equal(mapped[k], ours[k]) for k in mapped) and mapped["queue"].shape == ours["queue"].shape


def test_the_bn_order_forms_their_groups():
    order, splits = torch.randperm(32), 8
    theirs = [set(order[g::splits].tolist()) for g in range(splits)]  # their split BN: position mod 8
    ours = [set(c.tolist()) for c in se.grouped_order(order, splits).chunk(splits)]  # ours: consecutive chunks
    assert ours == theirs
