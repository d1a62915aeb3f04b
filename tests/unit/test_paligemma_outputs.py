"""PaliGemma's detection and segmentation answers (programs/detect.py, programs/segment.py) parsed
without a server: boxes back in the image's pixels (x by width / 1024, y by height / 1024, as
SigLIP's processor squashes the whole image), round trips through the answer text, the regexes
matching exactly what parses, and malformed answers raising ``ValueError`` that name the problem."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from programs.detect import (
    Detection, detect_prompt, detection_regex, format_detections, loc_tokens, parse_detections,
    parse_locs, to_locs, to_pixels,
)
from programs.segment import (
    Segmentation, format_segmentations, parse_codes, parse_segmentations, seg_tokens,
    segment_prompt, segmentation_regex,
)

bins = st.integers(0, 1023)
codes = st.lists(st.integers(0, 127), min_size=16, max_size=16).map(tuple)
labels = st.sampled_from(["cat", "dog", "red car", "person"])


@st.composite
def image_and_box(draw, max_side: int = 1023):
    width, height = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    x0, y0 = draw(st.integers(0, width - 1)), draw(st.integers(0, height - 1))
    return width, height, (x0, y0, draw(st.integers(x0 + 1, width)), draw(st.integers(y0 + 1, height)))


def test_the_prompts_are_paligemmas():
    assert detect_prompt(["cat", "dog"]) == "detect cat ; dog"
    assert segment_prompt("red car") == "segment red car"


def test_a_detection_answer_in_pixels():
    # y by height / 1024, x by width / 1024: a 512 x 256 image squashed to the model's square
    answer = "<loc0256><loc0512><loc0768><loc1023> cat ; <loc0000><loc0000><loc0100><loc0100> dog"
    cat, dog = parse_detections(answer, 512, 256)
    assert cat == Detection("cat", (256, 64, 512, 192), (256, 512, 768, 1023))
    assert dog.box == (0, 0, 50, 25) and dog.label == "dog"
    assert parse_detections("", 10, 10) == []


def test_a_segmentation_answer():
    answer = "<loc0000><loc0512><loc1023><loc1023>" + seg_tokens(tuple(range(16))) + " red car"
    (car,) = parse_segmentations(answer, 100, 40)
    assert car == Segmentation("red car", (50, 0, 100, 40), (0, 512, 1023, 1023), tuple(range(16)))


@settings(max_examples=300, deadline=None)
@given(image_and_box())
def test_pixel_boxes_round_trip_through_bins(case):
    width, height, box = case
    assert to_pixels(to_locs(box, width, height), width, height) == box


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.tuples(bins, bins, bins, bins))
def test_bins_give_a_box_inside_the_image_that_covers_them(width, height, locs):
    x0, y0, x1, y1 = to_pixels(locs, width, height)
    assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height
    ya, xa, yb, xb = locs  # the corners in either order
    assert x0 <= min(xa, xb) * width / 1024 and max(xa, xb) * width / 1024 <= x1
    assert y0 <= min(ya, yb) * height / 1024 and max(ya, yb) * height / 1024 <= y1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(labels, st.tuples(bins, bins, bins, bins)), min_size=1, max_size=4),
       st.integers(1, 2000), st.integers(1, 2000))
def test_detection_answers_round_trip_and_match_the_regex(objects, width, height):
    detections = [Detection(label, to_pixels(locs, width, height), locs) for label, locs in objects]
    answer = format_detections(detections)
    assert parse_detections(answer, width, height) == detections
    assert re.fullmatch(detection_regex(["cat", "dog", "red car", "person"], 4), answer)
    assert (re.fullmatch(detection_regex(["cat", "dog", "red car", "person"], 3), answer) is None) == \
        (len(objects) == 4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(labels, st.tuples(bins, bins, bins, bins), codes), min_size=1, max_size=3))
def test_segmentation_answers_round_trip_and_match_the_regex(objects):
    segmentations = [Segmentation(label, to_pixels(locs, 640, 480), locs, c) for label, locs, c in objects]
    answer = format_segmentations(segmentations)
    assert parse_segmentations(answer, 640, 480) == segmentations
    assert re.fullmatch(segmentation_regex(["cat", "dog", "red car", "person"], 3), answer)


def test_the_regexes_hold_only_valid_tokens():
    regex = detection_regex(["cat"])
    assert re.fullmatch(regex, "<loc1023><loc0000><loc0001><loc1000> cat")
    for bad in ("<loc1024><loc0000><loc0001><loc1000> cat", "<loc0001><loc0000><loc0001> cat",
                "<loc0001><loc0000><loc0001><loc0002> dog", "<loc0001><loc0000><loc0001><loc0002>cat",
                "<loc0001><loc0000><loc0001><loc0002> cat ; "):
        assert re.fullmatch(regex, bad) is None, bad
    one = "<loc0001><loc0000><loc0001><loc0002>" + seg_tokens([127] * 16) + " cat"
    assert re.fullmatch(segmentation_regex(["cat"]), one)
    assert re.fullmatch(segmentation_regex(["cat"]), one.replace("<seg127>", "<seg128>", 1)) is None
    assert re.fullmatch(segmentation_regex(["cat"]), one + " ; " + one) is None  # max_objects=1


GOOD = "<loc0001><loc0002><loc0003><loc0004>"


@pytest.mark.parametrize("answer, problem", [
    ("<loc0001><loc0002><loc0003> cat", "not four <locNNNN> tokens"),
    (GOOD + "cat", "not four <locNNNN> tokens"),
    (GOOD + " cat ; ", "group 1"),
    (GOOD + "  ", "has no label"),
    ("<loc0001><loc0002><loc0003><loc1024> cat", "past <loc1023>"),
    ("cat " + GOOD, "group 0"),
])
def test_malformed_detections_name_the_problem(answer, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_detections(answer, 100, 100)


@pytest.mark.parametrize("answer, problem", [
    (GOOD + "<seg001>" * 15 + " cat", "15 segmentation tokens"),
    (GOOD + "<seg001>" * 17 + " cat", "17 segmentation tokens"),
    (GOOD + "<seg001>" * 15 + "<seg128> cat", "past <seg127>"),
    (GOOD + " cat", "0 segmentation tokens"),
    ("<loc0001><loc0002><loc0003>" + "<seg001>" * 16 + " cat", "not four <locNNNN> tokens"),
])
def test_malformed_segmentations_name_the_problem(answer, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_segmentations(answer, 100, 100)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="between location tokens"):
        parse_locs("<loc0001> <loc0002>")
    with pytest.raises(ValueError, match="after the segmentation tokens"):
        parse_codes("<seg001>" * 16 + "x")
    with pytest.raises(ValueError, match="an int in"):
        loc_tokens([1024])
    with pytest.raises(ValueError, match="16 codes"):
        seg_tokens([1, 2])
    with pytest.raises(ValueError, match="positive size"):
        to_pixels((0, 0, 1, 1), 0, 10)
    with pytest.raises(ValueError, match="with an area inside"):
        to_locs((5, 5, 5, 9), 10, 10)
    with pytest.raises(ValueError, match="label 'a;b'"):
        detect_prompt(["a;b"])
    with pytest.raises(ValueError, match="the string 'cat'"):
        detection_regex("cat")
    with pytest.raises(ValueError, match="max_objects"):
        detection_regex(["cat"], 0)
