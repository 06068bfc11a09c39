"""Word lists the shipped dataset is built from (`eval/dataset.py`): common English words
a 135M model knows."""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((left, right) for left, right in (pair.split(":") for pair in text.split()))


# Classes to sort words into; the first SHOTS_PER_CLASS words of each are the examples.
CLASSES = {
    "animal/color/fruit": {
        "animal": _words(
            "dog cat horse lion tiger rabbit mouse sheep goat bear wolf fox duck frog monkey zebra"
        ),
        "color": _words("red blue green yellow purple orange pink brown black white gray violet"),
        "fruit": _words(
            "apple pear banana cherry grape lemon mango peach plum melon kiwi strawberry"
        ),
    },
    "day/month": {
        "day": _words("Monday Friday Tuesday Wednesday Thursday Saturday Sunday"),
        "month": _words(
            "March October January February April May June July August September November December"
        ),
    },
    "number/letter": {
        "number": _words("two nine one three four five six seven eight ten twelve twenty"),
        "letter": _words("B K A C D E F G H M P R"),
    },
}
SHOTS_PER_CLASS = 2

GOOD = _words("wonderful great excellent amazing delicious beautiful")
BAD = _words("terrible awful horrible boring disgusting ugly")
REVIEWED = _words("movie meal book hotel song game")

NUMBER_WORDS = _words(
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
)
ANTONYMS = _pairs(
    "hot:cold big:small up:down day:night fast:slow happy:sad open:closed left:right yes:no "
    "in:out good:bad high:low black:white full:empty wet:dry light:dark hard:soft long:short "
    "early:late push:pull"
)
CAPITALS = _pairs(
    "France:Paris Japan:Tokyo Italy:Rome Spain:Madrid Germany:Berlin England:London "
    "Russia:Moscow Egypt:Cairo China:Beijing Greece:Athens Ireland:Dublin Austria:Vienna"
)
PLURALS = _pairs(
    "cat:cats dog:dogs book:books tree:trees car:cars bird:birds cup:cups hat:hats box:boxes "
    "bus:buses apple:apples house:houses girl:girls boy:boys star:stars door:doors"
)

JSON_KEYS = _words("color name city animal fruit size day shape food")
JSON_VALUES = _words("red Tom Paris dog apple big Monday round bread")

STORY_HEROES = (
    "a small dragon",
    "a brave mouse",
    "a lost robot",
    "a young wizard",
    "an old fisherman",
    "a curious cat",
    "a friendly giant",
    "a little bird",
    "a shy princess",
    "a clever fox",
    "a sleepy bear",
    "a happy dog",
)
STORY_PLOTS = ("who finds a secret door", "who learns to fly", "who wants to see the sea")
