"""Word pools the families draw names and contents from.

Plain lowercase ASCII letters only, so that `sort` orders them the same in every locale and no
name needs quoting. Pools are large enough that a family's instances differ in content, not
only in file names (120 nouns: a pair of distinct nouns has 14,280 orderings).
"""

NOUNS = (
    "apple", "river", "stone", "cloud", "lemon", "tiger", "maple", "ocean", "pencil", "garden",
    "rocket", "candle", "forest", "silver", "planet", "window", "bridge", "castle", "dragon", "falcon",
    "harbor", "island", "jungle", "kettle", "ladder", "meadow", "needle", "orange", "parrot", "quartz",
    "rabbit", "saddle", "tunnel", "valley", "walnut", "yellow", "anchor", "basket", "copper", "desert",
    "engine", "feather", "glacier", "hammer", "iron", "jacket", "kernel", "lantern", "magnet", "nectar",
    "olive", "pepper", "quiver", "ribbon", "sparrow", "thunder", "umbrella", "violet", "wagon", "zebra",
    "acorn", "badger", "cactus", "dolphin", "ember", "fig", "goose", "hazel", "igloo", "jasmine",
    "koala", "lily", "mango", "nutmeg", "otter", "pebble", "quail", "raven", "salmon", "tulip",
    "urchin", "vapor", "willow", "yak", "almond", "beacon", "cedar", "daisy", "eagle", "fern",
    "granite", "heron", "ivory", "juniper", "kiwi", "lotus", "marble", "nickel", "onyx", "pine",
    "quince", "reef", "sage", "timber", "velvet", "wheat", "amber", "bison", "comet", "dune",
    "elm", "flint", "grove", "honey", "indigo", "jade", "kelp", "lynx", "moss", "north",
)

VERBS = (
    "runs", "jumps", "sings", "falls", "grows", "shines", "waits", "turns", "flows", "rests",
    "moves", "holds", "finds", "keeps", "drifts", "glows", "burns", "rises", "bends", "opens",
)

DIRS = (
    "data", "docs", "logs", "reports", "notes", "src", "build", "archive", "config", "backup",
    "inbox", "media", "share", "projects", "assets", "records", "drafts", "exports", "cache", "work",
)

STEM_SUFFIXES = ("notes", "list", "log", "report", "data", "items", "draft", "summary", "record", "index")

FIRST_NAMES = (
    "ada", "alan", "grace", "linus", "margaret", "dennis", "barbara", "ken", "frances", "edsger",
    "donald", "radia", "john", "hedy", "tim", "sophie", "guido", "anita", "niklaus", "karen",
)

CITIES = (
    "paris", "lisbon", "oslo", "rome", "vienna", "prague", "dublin", "madrid", "berlin", "athens",
    "warsaw", "zurich", "tallinn", "riga", "sofia", "bern",
)

JUNK_EXTENSIONS = ("tmp", "bak", "old", "swp", "cache")
KEEP_EXTENSIONS = ("txt", "csv", "md", "conf", "json")
