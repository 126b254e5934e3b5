"""The project's own offline prompt set for self-distillation and calibration (never MT-Bench).

Prompts are composed from request templates and topic lists written for this project, across the
eight kinds of request MT-Bench covers (writing, roleplay, reasoning, math, coding, extraction,
STEM, humanities); about a third carry a follow-up turn. A second tier of longer requests, with
material to work on and constraints on the answer, comes from :mod:`.prompts_detailed`; tiers 3
(:mod:`.prompts_open`) and 4 (:mod:`.prompts_wide`) stand apart, reached by name (``builtin-open``,
``builtin-wide``, ``builtin-all``). Composition is deterministic, so a prompt's index names the same prompt everywhere. Other sources
(ShareGPT-style JSON/JSONL, plain JSONL of prompts) load through :func:`load_prompt_source`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .prompts_detailed import detailed_requests
from .prompts_open import open_requests
from .prompts_wide import wide_requests

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BUILTIN_SOURCE = "medusa-bench/builtin"  # tier 1: short templates x topics
DETAILED_SOURCE = "medusa-bench/builtin-detailed"  # tier 2: longer requests with material and constraints
OPEN_SOURCE = "medusa-bench/builtin-open"  # tier 3: open questions, weighted to the kinds heads do worst
WIDE_SOURCE = "medusa-bench/builtin-wide"  # tier 4: other subjects, frames and record shapes
# --data names of the built-in sets: tiers 1-2 (the default), tier 3 alone, tier 4 alone, all four
BUILTIN_NAMES = ("builtin", "default", "", "builtin-open", "builtin-wide", "builtin-all")


@dataclass(frozen=True)
class Prompt:
    turns: tuple[str, ...]  # user turns; the assistant's replies come from the model itself
    category: str
    source: str = BUILTIN_SOURCE
    id: str = ""  # the record's own id (question_id, id or task_id) where it has one


_TOPICS = {
    "writing": ["a small bakery opening in a mountain town", "learning to swim as an adult", "a night train across Europe",
                "a community garden", "the first day at a new job", "a lost umbrella", "a power outage in the city",
                "a grandmother's recipe box", "a volunteer beach clean-up", "moving to a country with a new language",
                "an old bicycle repair shop", "a robot that learns to paint", "a rainy weekend at home",
                "a marathon in the desert", "a letter found in a library book", "a school science fair",
                "a lighthouse keeper's last winter", "a city festival of lanterns", "restoring an old sailboat",
                "a village without cars", "a chess tournament in a park", "the smell of a used bookshop",
                "a road trip with a broken radio", "a neighbour who keeps bees", "a startup that failed",
                "a snowstorm that closed the airport"],
    "roleplay": ["a ship's captain in a storm", "a museum tour guide", "a detective in 1920s London",
                 "a barista at a busy cafe", "a park ranger", "a medieval blacksmith", "a friendly librarian",
                 "a travel agent", "a chess coach", "a personal fitness trainer", "a customer support agent for a bank",
                 "an astronaut on the Moon", "a wedding planner", "a street food vendor", "a retired pilot",
                 "a mountain guide",
                 "a zookeeper caring for a baby elephant", "a sommelier at a small restaurant",
                 "a high-school history teacher", "a submarine engineer", "a fashion designer before a show",
                 "a tax advisor in April", "a lifeguard on a crowded beach", "a game show host",
                 "a Victorian-era inventor", "a veterinarian on a farm"],
    "reasoning": ["three friends sharing a pizza", "a clock that loses five minutes every hour",
                  "a farmer crossing a river with a goat, a wolf and a cabbage", "a race where you overtake second place",
                  "two trains leaving stations at different times", "a family with four daughters who each have a brother",
                  "a box of mixed red and blue socks in the dark", "a calendar puzzle about leap years",
                  "a lie detector in a room of knights and knaves", "a staircase climbed one or two steps at a time",
                  "a bag of coins with one counterfeit", "people standing in a queue by height",
                  "a bookshelf ordered by colour and size", "a meeting scheduled across three time zones",
                  "a tournament where every team plays every other team once",
                  "four people crossing a bridge with one torch", "a liar who always lies on Tuesdays",
                  "a birthday paradox in a class of 30", "two jugs of 3 and 5 litres measuring 4 litres",
                  "a snail climbing out of a well", "a will dividing 17 camels among three sons",
                  "a room with three light switches", "a scale and nine balls, one heavier",
                  "a hotel with infinitely many rooms"],
    "math": ["the area of a triangle with vertices (0,0), (4,0) and (1,3)", "the sum of the first 50 odd numbers",
             "solving 3x + 7 = 25", "the probability of two sixes with two dice", "compound interest of 5% over 3 years",
             "the derivative of x^3 - 2x", "the number of ways to arrange the letters of LEVEL",
             "the greatest common divisor of 84 and 126", "converting 0.375 to a fraction",
             "the volume of a cylinder with radius 3 and height 10", "the mean and median of 3, 8, 8, 10, 21",
             "the solutions of x^2 - 5x + 6 = 0", "the 10th term of the sequence 2, 5, 8, 11",
             "the integral of 2x from 0 to 3", "how many primes lie below 30",
             "the perimeter of a rectangle with sides 7 and 12", "the factorial of 7",
             "the slope of the line through (1,2) and (4,11)", "the percentage increase from 80 to 100",
             "the expected value of one roll of a fair die", "the least common multiple of 12 and 18",
             "the square root of 196", "the sum of the angles of a hexagon", "the binary representation of 45",
             "the inverse of the function f(x) = 2x + 1"],
    "coding": ["reversing a linked list", "checking whether a string is a palindrome", "merging two sorted lists",
               "counting word frequencies in a text file", "binary search in a sorted array",
               "removing duplicates from a list while keeping order", "parsing a CSV file into dictionaries",
               "computing Fibonacci numbers with memoisation", "validating an email address with a regular expression",
               "finding the longest common prefix of several strings", "a stack that supports getting the minimum",
               "flattening a nested list", "rotating a matrix by 90 degrees", "a simple LRU cache",
               "detecting a cycle in a directed graph",
               "implementing quicksort", "checking whether two strings are anagrams", "a queue built from two stacks",
               "finding the k largest elements of a list", "reading a JSON file and printing its keys",
               "a breadth-first search on a grid", "converting Roman numerals to integers",
               "counting the islands in a grid", "a rate limiter for an API", "the edit distance between two words"],
    "extraction": ["a paragraph announcing three product launches with prices and dates",
                   "a short news item about a city council vote", "a recipe with ingredients and cooking times",
                   "an email confirming a hotel booking", "a table of quarterly sales by region written as prose",
                   "a job advertisement with salary and requirements", "a weather report for four cities",
                   "a train timetable described in sentences", "a paragraph of customer reviews with star ratings",
                   "meeting notes listing decisions and owners", "a biography with birth dates and places",
                   "an invoice described in plain text", "a sports match report with scores",
                   "a library notice about opening hours",
                   "a product review mentioning battery life and price", "a press release about a company merger",
                   "a school timetable for one week", "a doctor's appointment reminder",
                   "a travel itinerary with flights and hotels", "a real-estate listing with rooms and prices",
                   "a conference programme with speakers and times", "a bank statement described in words",
                   "a museum exhibition announcement", "a list of birthdays in a family letter"],
    "stem": ["photosynthesis", "how vaccines train the immune system", "why the sky is blue", "plate tectonics",
             "how a transistor works", "the water cycle", "black holes", "how batteries store energy",
             "natural selection", "the greenhouse effect", "how GPS finds your position", "DNA replication",
             "the difference between weather and climate", "how airplanes generate lift", "nuclear fusion in stars",
             "how antibiotics work",
             "how vaccines are tested", "how the heart pumps blood", "the speed of light",
             "how earthquakes are measured", "quantum entanglement", "how computers store numbers in binary",
             "the life cycle of a star", "how bridges carry loads", "why ice floats", "how the internet routes data"],
    "humanities": ["the causes of the French Revolution", "the printing press and its effect on Europe",
                   "the Silk Road", "the philosophy of Stoicism", "the Renaissance in Florence",
                   "the abolition of slavery in the nineteenth century", "the role of myths in ancient Greece",
                   "the Industrial Revolution and cities", "the history of the Olympic Games",
                   "the invention of writing in Mesopotamia", "the impressionist painters",
                   "the fall of the Western Roman Empire", "the Harlem Renaissance", "utilitarian ethics",
                   "the spread of Buddhism", "the history of jazz",
                   "the Magna Carta", "the invention of the telephone", "the Cold War", "the Mughal Empire",
                   "Confucian ethics", "the history of map making", "the Dutch Golden Age",
                   "the civil rights movement in the United States", "the Meiji Restoration",
                   "existentialism in literature"],
}

_TEMPLATES = {
    "writing": ["Write a short blog post about {t}.", "Write a 150-word story about {t}.",
                "Write a persuasive paragraph inviting people to experience {t}.", "Write a poem about {t}.",
                "Draft a friendly email to a colleague describing {t}.", "Write a diary entry about {t}.",
                "Write the opening paragraph of a novel about {t}.", "Write a product description inspired by {t}."],
    "roleplay": ["Pretend you are {t}. Introduce yourself and describe a typical day.",
                 "Act as {t} and give advice to a nervous beginner.",
                 "You are {t}. A visitor asks what the hardest part of your work is. Answer in character.",
                 "Role-play as {t} explaining a surprising story from your career.",
                 "Stay in character as {t} and answer: what should I know before we start?",
                 "Imagine you are {t}. Describe the best decision you ever made."],
    "reasoning": ["Solve this puzzle step by step: {t}.", "Explain the trick behind the riddle about {t}.",
                  "Reason carefully and give the answer: a question involving {t}.",
                  "Think through {t} and explain where people usually go wrong.",
                  "Create a logic puzzle about {t} and then solve it."],
    "math": ["Compute {t}. Show your steps.", "Explain how to find {t}.", "What is {t}? Explain briefly.",
             "A student asks about {t}. Give a clear worked solution.",
             "Check this: a friend says the answer to {t} is 12. Are they right?"],
    "coding": ["Write a Python function for {t}.", "Explain an efficient algorithm for {t} and give code.",
               "Write a JavaScript function for {t}, with a short explanation.",
               "What is the time complexity of {t}? Give an implementation.",
               "Write unit tests for a function that does {t}.", "Write a C++ function for {t}."],
    "extraction": ["Invent {t}, then extract the key facts from it as a JSON object.",
                   "Write {t}. Then list every date and number that appears in it.",
                   "Create {t} and summarise it as a bullet list of names, places and amounts.",
                   "Given {t} that you make up, extract the entities into a table.",
                   "Compose {t}, then answer: which items are mentioned and what do they cost?"],
    "stem": ["Explain {t} to a high-school student.", "Describe {t} in three paragraphs.",
             "What are common misconceptions about {t}?", "Explain {t} using an everyday analogy.",
             "Give a short technical overview of {t}.", "Why does {t} matter for everyday life?"],
    "humanities": ["Summarise {t} in a few paragraphs.", "What were the main consequences of {t}?",
                   "Explain {t} to someone who knows nothing about it.",
                   "Compare two different views on {t}.", "Write a short essay on {t}.",
                   "What can we learn today from {t}?"],
}

_FOLLOW_UPS = ["Now make it shorter, in two sentences.", "Can you give a concrete example?",
               "Rewrite your answer for a ten-year-old.", "Turn your answer into a numbered list.",
               "What would you change if you had to explain it again?", "Add a title and a one-line summary.",
               "Now answer the same question in a more formal tone.", "Which part of your answer is most important?"]


BUILTIN_REVISION = 2  # bump when the built-in prompt set changes (stage caches key on it)
BUILTIN_TRAIN_SHARE = 0.8  # per tier: the first 80 % train heads, the rest calibrate them


def _template_prompts(seed: int) -> list[Prompt]:
    """Every template x topic pair (about 1,200), in a fixed shuffled order; a third get a follow-up."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    for cat in CATEGORIES:
        for t_index, template in enumerate(_TEMPLATES[cat]):
            for topic in _TOPICS[cat]:
                turns = [template.format(t=topic)]
                if rng.random() < 1 / 3:
                    turns.append(_FOLLOW_UPS[(t_index + len(topic)) % len(_FOLLOW_UPS)])
                out.append(Prompt(tuple(turns), cat))
    rng.shuffle(out)
    return out


def builtin_prompts(seed: int = 0) -> list[Prompt]:
    """Tiers 1 and 2 (``--data builtin``): the template prompts (first, in their historical order), then
    the detailed requests."""
    detailed = [Prompt(turns, cat, DETAILED_SOURCE) for turns, cat in detailed_requests(seed=seed + 1)]
    return _template_prompts(seed) + detailed


def open_prompts(seed: int = 0) -> list[Prompt]:
    """Tier 3 (``--data builtin-open``): 500 open questions, apart from the default set so that the quick
    profile, the bench's calibration prompts and the release data of tiers 1-2 stay as they were."""
    return [Prompt(turns, cat, OPEN_SOURCE) for turns, cat in open_requests(seed=seed + 2)]


def wide_prompts(seed: int = 0) -> list[Prompt]:
    """Tier 4 (``--data builtin-wide``): 1,200 requests on other subjects, in other frames, apart from the
    default set like tier 3."""
    return [Prompt(turns, cat, WIDE_SOURCE) for turns, cat in wide_requests(seed=seed + 3)]


def _interleave(parts: list[list[Prompt]]) -> list[Prompt]:
    """Merge lists keeping each one's order, spreading each evenly over the result (so any prefix
    holds every tier in proportion)."""
    keyed = [((i + 0.5) / len(part), k, p) for k, part in enumerate(parts) for i, p in enumerate(part)]
    return [p for _, _, p in sorted(keyed, key=lambda x: (x[0], x[1]))]


def builtin_split(prompts: list[Prompt], part: str) -> list[Prompt]:
    """The ``train`` or ``calibration`` part of the built-in prompts: each tier is cut at 80 % (so a
    tier's split never depends on the others) and the parts of the tiers are interleaved."""
    if part not in ("train", "calibration"):
        raise ValueError(f"part must be 'train' or 'calibration', not {part!r}")
    tiers: dict[str, list[Prompt]] = {}
    for p in prompts:
        tiers.setdefault(p.source, []).append(p)
    chosen = []
    for tier in tiers.values():
        cut = int(len(tier) * BUILTIN_TRAIN_SHARE)
        chosen.append(tier[:cut] if part == "train" else tier[cut:])
    return _interleave([c for c in chosen if c])


def _prompt_from_record(rec: dict, source: str) -> Prompt | None:
    """ShareGPT (``conversations``/``messages``), MT-Bench-like (``turns``) or plain (``prompt``/``text``)."""
    if "conversations" in rec or "messages" in rec:
        conv = rec.get("conversations") or rec.get("messages") or []
        turns = tuple(str(m.get("value", m.get("content", ""))) for m in conv
                      if str(m.get("from", m.get("role", ""))).lower() in ("human", "user"))
    elif "turns" in rec:
        turns = tuple(str(t) for t in rec["turns"])
    else:
        text = rec.get("prompt", rec.get("instruction", rec.get("text")))
        turns = (str(text),) if text else ()
    turns = tuple(t for t in turns if t.strip())
    rid = next((rec[k] for k in ("question_id", "id", "task_id") if rec.get(k) is not None), "")
    return Prompt(turns, str(rec.get("category", "other")), source, str(rid)) if turns else None


def _load_with_datasets(source: str, path: Path) -> list[dict]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError(f"reading {source} needs the datasets library: pip install 'medusa-bench[data]'") from None
    if path.suffix == ".parquet":
        return list(load_dataset("parquet", data_files=str(path), split="train"))
    return list(load_dataset(source, split="train"))


def load_prompt_source(source: str, limit: int | None = None) -> list[Prompt]:
    """``builtin`` (default), a local JSON/JSONL file, or a parquet file or (online users) a hub dataset id via the
    ``datasets`` library (the ``data`` extra)."""
    if source in BUILTIN_NAMES:
        prompts = {"builtin-open": open_prompts, "builtin-wide": wide_prompts,
                   "builtin-all": lambda: builtin_prompts() + open_prompts() + wide_prompts()
                   }.get(source, builtin_prompts)()
    else:
        path = Path(source)
        if path.is_file() and path.suffix != ".parquet":
            text = path.read_text()
            try:
                records = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines()
                                                                           if x.strip()]
            except json.JSONDecodeError as exc:
                raise ValueError(f"prompt file {source} is not valid JSON/JSONL: {exc.msg} (line {exc.lineno})") from None
        elif not path.is_file() and (path.suffix in (".json", ".jsonl", ".parquet") or source.startswith((".", "/"))):
            raise FileNotFoundError(f"prompt file not found: {source}")
        else:  # a parquet file, or (online users) a hub dataset id: the datasets library reads them
            records = _load_with_datasets(source, path)
        if isinstance(records, dict):
            records = [records]
        prompts = [p for r in records if isinstance(r, dict) and (p := _prompt_from_record(r, source))]
        if not prompts:
            raise ValueError(f"no prompts found in {source}")
    return prompts[:limit] if limit else prompts
