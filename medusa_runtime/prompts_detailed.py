"""The second tier of the built-in prompt set: longer, more specific requests.

The first tier (:mod:`medusa_runtime.prompts`) crosses a few short templates with topic lists, so
its requests look alike. Real chat requests carry material to work on (a passage to extract from,
numbers to compute with, code to fix, a paragraph to edit) and constraints on the answer (length,
format, audience, tone). This tier composes such requests from parts written for this project:
passages and word problems are filled with random names, dates and numbers, and every request
draws a form, a subject and a constraint, so no two are alike. Composition is seeded and
deterministic. Nothing here is taken from MT-Bench (a test checks that no 6-word span is shared).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

_NAMES = ["Amara", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kavya", "Lars",
          "Mei", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Ursula", "Viktor", "Wen", "Yara",
          "Zoltan", "Aisha", "Ben", "Clara", "Diego", "Emma"]
_CITIES = ["Porto", "Kraków", "Osaka", "Nairobi", "Valparaíso", "Tallinn", "Halifax", "Ghent", "Hobart", "Izmir",
           "Bergen", "Cusco", "Leipzig", "Da Nang", "Marrakesh", "Ljubljana", "Adelaide", "Quebec City"]
_COMPANIES = ["Northwind Optics", "Bluefern Foods", "Quillby Software", "Arcturus Motors", "Helios Grid",
              "Pebble & Pine", "Tidewater Logistics", "Ostara Health", "Lumen Textiles", "Kestrel Aerospace",
              "Marlow Books", "Vantage Robotics", "Greyhaven Insurance", "Solstice Beverages"]
_PRODUCTS = ["a folding e-bike", "a smart thermostat", "a noise-cancelling headset", "a solar phone charger",
             "a compact dishwasher", "a budgeting app", "a children's tablet", "a running watch", "an air purifier",
             "a cordless drill", "a travel backpack", "a language-learning course", "a robot vacuum"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]

_WRITING_FORMS = ["a blog post", "a formal letter", "a two-minute speech", "a newsletter article", "a cover letter",
                  "a restaurant review", "a short story", "a sequence of three haiku", "a limerick", "a press release",
                  "a social media post", "a script for a 30-second radio advert", "a book review", "a letter of complaint",
                  "an apology email to a customer", "a toast for a retirement party", "a diary entry",
                  "a one-page essay outline with headings", "a product FAQ with five questions", "a thank-you note"]
_WRITING_SUBJECTS = ["a weekend of hiking in the Scottish Highlands", "a neighbourhood repair café",
                     "switching a small office to a four-day week", "a new night bus route", "a charity bike ride",
                     "a failed attempt to bake sourdough bread", "the reopening of a town swimming pool",
                     "a ferry trip between two islands", "a flea market that sells only old maps",
                     "a school that replaced homework with reading time", "a delayed flight that led to a friendship",
                     "a local choir preparing for its first concert", "a family moving into a houseboat",
                     "a street that banned cars for a summer", "an app that reminds people to drink water",
                     "a tiny museum of broken objects", "a chef who cooks only with seasonal vegetables",
                     "a mountain hut run by volunteers", "a lost dog that found its way home",
                     "a community radio station", "a library that lends tools", "the first snow of the year"]
_AUDIENCES = ["for teenagers", "for busy parents", "for a company newsletter", "for readers who have never travelled",
              "for retired teachers", "for a local newspaper", "for first-year university students",
              "for people who are sceptical of change", "for a children's magazine", "for potential investors"]
_WRITING_CONSTRAINTS = ["Keep it under 200 words.", "Use exactly three paragraphs.", "Give it a catchy title.",
                        "End with a question for the reader.", "Use a light, humorous tone.",
                        "Mention at least two concrete details such as a price, a time or a name.",
                        "Write it in the second person.", "Use short sentences and no jargon.",
                        "Include one quotation from an imaginary local resident.",
                        "Start with a surprising fact.", "Make the tone warm but professional.",
                        "Finish with a clear call to action."]
_VERBS = ["Write", "Compose", "Draft", "Create", "Prepare"]

_EDIT_TEXTS = ["Me and my brother goes to the market every saturdays, we buys apple and some breads. The seller are "
               "always friendly but the prices is to high for us.",
               "Their going to announce the results tomorow, however nobody know exactly when. Its been a long week "
               "and everyone are tired of waiting.",
               "The report, which were written in a hurry, contain several mistake and it dont explain the main "
               "findings clear enough for the board to understanding.",
               "When I arrived to the station the train has already leave, so I have to wait two hour in the cold "
               "without nothing to eat.",
               "Our team have worked very hardly on this project and we believes that the results speaks for "
               "themself, despite of the delays."]

_CHARACTERS = ["a grumpy lighthouse keeper", "a cheerful pirate cook", "a retired astronaut who now grows tomatoes",
               "a Roman centurion visiting the present day", "a detective who solves cases by smell",
               "a robot butler learning human manners", "a medieval court jester", "an overworked fairy godmother",
               "a deep-sea diver", "a time traveller from the year 2300", "a nervous dragon guarding a library",
               "a jazz musician in 1950s Paris", "a polar explorer writing home", "a wise old tortoise",
               "a tour guide on Mars", "a night-shift nurse", "a chess grandmaster", "a sushi chef",
               "a mountain rescue volunteer", "a sceptical ghost", "a startup founder pitching to investors",
               "a kind but strict driving instructor"]
_ROLE_SITUATIONS = ["A visitor asks you what you fear most.", "A child asks why you chose your life.",
                    "Someone asks for your three best pieces of advice.", "A journalist asks about your biggest mistake.",
                    "A customer complains that things are taking too long.", "A friend asks you to explain your job.",
                    "You must convince a crowd to follow your plan.", "Someone doubts that you are who you say you are.",
                    "A stranger asks you for directions to the nearest bakery.",
                    "You are asked to describe your perfect day."]
_ROLE_STYLES = ["Stay in character and answer in no more than 120 words.", "Answer in character, with a touch of humour.",
                "Use the vocabulary of your profession.", "Do not mention that you are an AI.",
                "Speak in the first person and keep it vivid.", "Answer as a short monologue."]
_COACHES = ["a nutritionist", "a career counsellor", "an interior designer", "a debate coach", "a travel planner",
            "a personal finance advisor", "a gardening expert", "a language tutor", "a sleep coach",
            "a public-speaking mentor", "a museum curator", "a mediator between two roommates"]
_COACH_REQUESTS = ["I have a small budget and a lot of questions.", "I am starting from zero and feel overwhelmed.",
                   "I need a plan for the next four weeks.", "I keep making the same mistake and want to stop.",
                   "I want three options with their pros and cons.", "I need help preparing for an important week."]

_CODE_TASKS = ["returns the second largest number in a list", "checks whether a year is a leap year",
               "counts the vowels in a string", "converts a temperature from Celsius to Fahrenheit and back",
               "finds all pairs in an array that add up to a target", "groups a list of words by their first letter",
               "returns the running average of a stream of numbers", "validates a password against five rules",
               "splits a list into chunks of a given size", "finds the most frequent character in a string",
               "merges overlapping intervals", "computes the n-th row of Pascal's triangle",
               "checks whether brackets in a string are balanced", "transposes a matrix stored as a list of lists",
               "finds the missing number in a list containing 1 to n", "compresses a string like aaabb into a3b2",
               "returns the longest word in a sentence", "shuffles a list without using a library shuffle",
               "converts an integer to its English words", "finds the first non-repeating character",
               "computes the dot product of two vectors", "checks whether a number is a power of two",
               "sorts a list of dictionaries by a given key", "computes the day of the week for a date",
               "finds the longest increasing subsequence", "evaluates a simple arithmetic expression in a string"]
_LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C#"]
_CODE_CONSTRAINTS = ["Include a short docstring and two example calls.", "Do not use any external libraries.",
                     "Explain its time and space complexity afterwards.", "Handle empty input gracefully.",
                     "Add type annotations.", "Write it iteratively, not recursively.",
                     "Then write three test cases for it.", "Keep it under 20 lines."]
_BUGGY = [("Python", "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1"),
          ("Python", "def is_sorted(xs):\n    for i in range(len(xs)):\n        if xs[i] > xs[i + 1]:\n            return False\n    return True"),
          ("JavaScript", "function sum(arr) {\n  let s;\n  for (let i = 0; i <= arr.length; i++) s += arr[i];\n  return s;\n}"),
          ("Python", "def count_words(text):\n    counts = {}\n    for w in text.split():\n        counts[w] += 1\n    return counts"),
          ("C++", "int maxOf(vector<int> v) {\n    int m = 0;\n    for (int x : v) if (x > m) m = x;\n    return m;\n}"),
          ("Python", "def reverse_words(s):\n    words = s.split(' ')\n    return ' '.join(words.reverse())")]
_SQL = ["the three customers who spent the most in 2023, from tables customers(id, name) and orders(id, customer_id, "
        "amount, date)", "the average salary per department, from a table employees(id, name, department, salary)",
        "all products that have never been ordered, from tables products(id, name) and order_items(order_id, product_id)",
        "the number of new users per month, from a table users(id, created_at)",
        "the best-selling product in each category, from tables products(id, name, category) and sales(product_id, qty)"]

_STEM_TOPICS = ["how a refrigerator moves heat", "why bread rises", "how noise-cancelling headphones work",
                "how a vaccine's effectiveness is measured", "what causes ocean tides", "how solar panels turn light into current",
                "why some materials are magnetic", "how the kidneys filter blood", "how a search engine ranks pages",
                "what an enzyme does", "how rockets steer in space", "why metals conduct electricity",
                "how the eye focuses light", "how compound interest grows", "what limits the speed of a computer chip",
                "how wind turbines are placed", "how a neural network learns", "why the Moon shows phases",
                "how soap removes grease", "how hurricanes form", "how carbon dating works",
                "what a p-value means", "how bees communicate", "how lithium-ion batteries age"]
_STEM_FRAMES = ["Explain {t}, and say what limits it in practice.",
                "Describe a simple experiment a school class could do to show {t}.",
                "A friend thinks they understand {t} but mixes up cause and effect. Explain it carefully.",
                "Give a step-by-step explanation of {t}, with one equation if it helps.",
                "Explain {t} in two paragraphs, then list three common misunderstandings.",
                "What are the main trade-offs engineers or scientists face regarding {t}?",
                "Summarise {t} for a curious twelve-year-old, using one analogy.",
                "Write a short quiz of four questions, with answers, about {t}."]

_HUM_TOPICS = ["the rise of coffee houses in eighteenth-century London", "the Hanseatic League", "the invention of paper money",
               "the Bauhaus movement", "the printing of the first encyclopaedias", "the history of public libraries",
               "the ethics of lying to protect someone", "the idea of the social contract", "the Columbian exchange",
               "the spread of railways in the nineteenth century", "the role of guilds in medieval towns",
               "free will and determinism", "the history of vaccination campaigns", "the economics of minimum wages",
               "how inflation affects savers and borrowers", "the link between interest rates and house prices",
               "the history of the postal service", "the origins of democracy in Athens", "the tragedy of the commons",
               "why empires decline", "the philosophy of happiness in Aristotle", "the women's suffrage movement",
               "the history of chocolate", "the cultural impact of television"]
_HUM_FRAMES = ["Discuss {t}. Give two arguments on each side and your own conclusion.",
               "Write a short lesson plan on {t} for a class of fifteen-year-olds, with three activities.",
               "Explain {t} and how it still shapes the world today. Use three concrete examples.",
               "What did critics of the time say about {t}, and were they right?",
               "List five key facts about {t}, each with a one-sentence explanation.",
               "Compare {t} with a similar development in another part of the world.",
               "Write a balanced 250-word essay on {t}.",
               "Suggest three books or films about {t} and say what each one teaches."]

_FOLLOW_UPS = {
    "writing": ["Now rewrite it for a much younger audience.", "Make it half as long without losing the main point.",
                "Write a different ending.", "Turn it into a bullet-point summary of four lines."],
    "roleplay": ["Stay in character: what would you do tomorrow?", "Now answer the same question as your rival would.",
                 "Describe the same moment from the visitor's point of view.", "Give one more piece of advice, in character."],
    "reasoning": ["What if the numbers were doubled? Does the answer change?", "Explain the answer in one sentence.",
                  "Is there another way to reach the same answer?", "Make up a harder version and solve it."],
    "math": ["Now check your answer another way.", "Explain the method to someone who missed the lesson.",
             "Change one number in the problem and solve it again.", "Which step is the easiest to get wrong?"],
    "coding": ["Now rewrite it in another programming language.", "Can you make it faster? Explain how.",
               "Add error handling and explain your choices.", "Write a short docstring and usage example."],
    "extraction": ["Now return the same information as YAML.", "Which item has the highest value? Answer in one line.",
                   "Sort the extracted records by date.", "Add a field that says whether each entry is complete."],
    "stem": ["Give a real-world example of this.", "What is still unknown or debated about it?",
             "Explain it again using only everyday words.", "How would you measure this at home?"],
    "humanities": ["Which source would you trust most on this, and why?", "Summarise your answer in three sentences.",
                   "How might someone from that period have seen it?", "What is one modern parallel?"],
}


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(2019, 2026)}"


def _writing(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return f"Correct the grammar and spelling in the following paragraph, then explain two of your changes: " \
               f"\"{rng.choice(_EDIT_TEXTS)}\""
    return (f"{rng.choice(_VERBS)} {rng.choice(_WRITING_FORMS)} about {rng.choice(_WRITING_SUBJECTS)} "
            f"{rng.choice(_AUDIENCES)}. {rng.choice(_WRITING_CONSTRAINTS)}")


def _roleplay(rng: random.Random) -> str:
    if rng.random() < 0.35:
        return (f"Take the role of {rng.choice(_COACHES)}. I will describe my situation and you will respond with "
                f"practical suggestions. {rng.choice(_COACH_REQUESTS)}")
    return f"You are {rng.choice(_CHARACTERS)}. {rng.choice(_ROLE_SITUATIONS)} {rng.choice(_ROLE_STYLES)}"


def _reasoning(rng: random.Random) -> str:
    a, b, c, d = rng.sample(_NAMES, 4)
    kind = rng.randrange(7)
    if kind == 0:
        return (f"{a} is older than {b}. {c} is younger than {b} but older than {d}. Who is the youngest, and who "
                f"is the second oldest? Explain your reasoning.")
    if kind == 1:
        n = rng.randint(5, 14)
        return (f"At a meeting of {n} people, each person shakes hands once with every other person. How many "
                f"handshakes happen? Explain, then say how the count changes if {a} arrives late and only greets half of them.")
    if kind == 2:
        x, y, z = rng.randint(2, 9) * 10, rng.randint(2, 9) * 10, rng.randint(2, 9) * 10
        return (f"{a} walks {x} metres north, turns right and walks {y} metres, then turns right again and walks "
                f"{z} metres. Which way is {a} facing now, and how far from the starting point? Reason step by step.")
    if kind == 3:
        yrs, age_b = rng.randint(3, 12), rng.randint(5, 30)
        return (f"In {yrs} years, {a} will be twice as old as {b} is now. {b} is {age_b} today. How old is {a} "
                f"today? Show the reasoning and check the answer.")
    if kind == 4:
        h, m, dur, gap = rng.randint(8, 16), rng.choice([0, 15, 20, 30, 45]), rng.choice([40, 50, 75, 90]), rng.randint(5, 25)
        return (f"A workshop starts at {h}:{m:02d} and lasts {dur} minutes. A second session starts {gap} minutes "
                f"after the first ends and lasts half as long. When does the second session end?")
    if kind == 5:
        return (f"{a}, {b} and {c} each own one pet: a cat, a parrot and a rabbit. {a} is allergic to fur. {b} "
                f"does not own the rabbit. Who owns which pet? Explain how you eliminate the options.")
    return (f"Statement 1: every member of the {rng.choice(['chess', 'rowing', 'film', 'robotics'])} club is a "
            f"student. Statement 2: some students live in {rng.choice(_CITIES)}. Does it follow that some club "
            f"members live there? Answer true, false or uncertain, and explain.")


def _math(rng: random.Random) -> str:
    kind = rng.randrange(10)
    r = rng.randint
    if kind == 0:
        return f"Solve for x: {r(2, 9)}x + {r(1, 30)} = {r(1, 9)}x - {r(1, 30)}. Show each step."
    if kind == 1:
        pts = ", ".join(f"({r(-5, 8)}, {r(-5, 8)})" for _ in range(3))
        return f"Find the area of the triangle whose corners are {pts}. Explain the formula you use."
    if kind == 2:
        return f"Two fair six-sided dice are thrown. What is the probability that the sum is {r(3, 11)}? Explain by counting outcomes."
    if kind == 3:
        p, rate, yrs = r(5, 50) * 100, r(2, 9), r(2, 6)
        return f"You deposit ${p} at {rate}% interest compounded yearly. How much is in the account after {yrs} years?"
    if kind == 4:
        nums = sorted(r(1, 60) for _ in range(rng.choice([5, 6, 7])))
        rng.shuffle(nums)
        return f"For the numbers {', '.join(map(str, nums))}, compute the mean, the median and the range."
    if kind == 5:
        a, b = r(2, 12), r(2, 12)
        return f"Solve the system: x + y = {a + b}, x - y = {a - b}. Then verify the solution."
    if kind == 6:
        n, cost, qty = rng.choice(_NAMES), r(3, 25), r(2, 9)
        return (f"{n} buys {qty} notebooks at ${cost} each and pays with a ${(qty * cost // 50 + 1) * 50} note. "
                f"A {r(5, 25)}% discount applies to the notebooks. How much change does {n} get?")
    if kind == 7:
        v1, v2, dist = r(40, 90), r(40, 90), r(100, 600)
        return (f"Two cars start {dist} km apart and drive towards each other at {v1} km/h and {v2} km/h. "
                f"After how long do they meet, and where?")
    if kind == 8:
        a, b = r(2, 9), r(1, 9)
        return f"Find the roots of x^2 - {a + b}x + {a * b} = 0 and check them by substitution."
    return f"What is the remainder when {r(100, 9999)} is divided by {r(3, 13)}? Explain a quick way to find it."


def _coding(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        lang, code = rng.choice(_BUGGY)
        return f"This {lang} code has a bug. Find it, explain it and give a corrected version:\n\n{code}"
    if kind < 0.25:
        return f"Write an SQL query that returns {rng.choice(_SQL)}. Explain each clause."
    return (f"Write a {rng.choice(_LANGUAGES)} function that {rng.choice(_CODE_TASKS)}. "
            f"{rng.choice(_CODE_CONSTRAINTS)}")


def _passage(rng: random.Random) -> tuple[str, str]:
    """A passage with random facts, and the kind of records it holds."""
    kind = rng.randrange(4)
    if kind == 0:
        items = [f"{co} announced on {_date(rng)} that {p} will go on sale in {city} for ${rng.randint(20, 900)}."
                 for co, p, city in zip(rng.sample(_COMPANIES, 3), rng.sample(_PRODUCTS, 3), rng.sample(_CITIES, 3))]
        return " ".join(items), "company, product, city, price and date"
    if kind == 1:
        items = [f"{n} from {city} joined {co} as {rng.choice(['head of sales', 'an engineer', 'chief financial officer', 'a designer', 'an analyst'])} in {rng.choice(_MONTHS)} {rng.randint(2015, 2025)}."
                 for n, city, co in zip(rng.sample(_NAMES, 3), rng.sample(_CITIES, 3), rng.sample(_COMPANIES, 3))]
        return " ".join(items), "person, home city, company, role and start date"
    if kind == 2:
        items = [f"In {q}, {co} reported revenue of ${rng.randint(2, 90)} million and a profit of ${rng.randint(-5, 20)} million."
                 for q, co in zip(rng.sample(["the first quarter", "the second quarter", "the third quarter", "the fourth quarter"], 3),
                                  rng.sample(_COMPANIES, 3))]
        return " ".join(items), "company, quarter, revenue and profit"
    items = [f"The train from {a} to {b} leaves at {rng.randint(5, 22)}:{rng.choice(['05', '20', '35', '50'])} and "
             f"takes {rng.randint(1, 9)} hours {rng.randint(0, 59)} minutes; a ticket costs €{rng.randint(15, 180)}."
             for a, b in [rng.sample(_CITIES, 2) for _ in range(3)]]
    return " ".join(items), "origin, destination, departure time, duration and price"


def _extraction(rng: random.Random) -> str:
    text, fields = _passage(rng)
    fmt = rng.choice(["a JSON list of objects", "CSV with a header row", "a Markdown table", "one line per record"])
    return f"Read the text below and extract the {fields} of every record. Output {fmt}.\n\nText: {text}"


def _stem(rng: random.Random) -> str:
    return rng.choice(_STEM_FRAMES).format(t=rng.choice(_STEM_TOPICS))


def _humanities(rng: random.Random) -> str:
    return rng.choice(_HUM_FRAMES).format(t=rng.choice(_HUM_TOPICS))


_MAKERS = {"writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math, "coding": _coding,
           "extraction": _extraction, "stem": _stem, "humanities": _humanities}


Request = tuple[tuple[str, ...], str]  # (user turns, category)


def distinct_requests(rng: random.Random, makers: dict[str, tuple[Callable[[random.Random], str], int]],
                      follow_ups: Callable[[str], Sequence[str]], follow_share: float) -> list[Request]:
    """For each category, draw from its maker until it has given ``count`` distinct requests (at most
    50 draws per request wanted); each gets a follow-up turn with probability ``follow_share``. The
    result is shuffled with ``rng`` too, so one seed fixes the whole list."""
    out: list[Request] = []
    for cat, (make, count) in makers.items():
        seen: set[str] = set()
        for _ in range(count * 50):
            if len(seen) == count:
                break
            text = make(rng)
            if text in seen:
                continue
            seen.add(text)
            turns = (text, rng.choice(follow_ups(cat))) if rng.random() < follow_share else (text,)
            out.append((turns, cat))
    rng.shuffle(out)
    return out


def detailed_requests(per_category: int = 80, seed: int = 1) -> list[Request]:
    """``per_category`` distinct requests per category as (turns, category), in a fixed shuffled order;
    about 40 % carry a follow-up turn (the small pools, stem and humanities, still hold 192 distinct
    requests)."""
    makers = {cat: (make, per_category) for cat, make in _MAKERS.items()}
    return distinct_requests(random.Random(seed), makers, _FOLLOW_UPS.__getitem__, 0.4)
