"""The third tier of the built-in prompt set: open questions, weighted towards the kinds where heads
measure worst.

The first two tiers (:mod:`medusa_runtime.prompts`, :mod:`medusa_runtime.prompts_detailed`) hold
templated requests and requests with material; heads trained on them reach their lowest accuracy on
explanations of science and of the humanities, on extraction from prose, and on open writing and
role-play. This tier asks such things in other words and about other subjects: an explanation, a
comparison, a cause, a misconception, a how-to, an opinion piece or a scene, each drawn from frames
and subject lists written for this project, and extraction from short notes, e-mails and schedules
filled with random names, times and amounts. Composition is seeded and deterministic. Nothing here
is taken from MT-Bench (a test checks that no 6-word span is shared).
"""

from __future__ import annotations

import random

from .prompts_detailed import Request, distinct_requests

_STEM_SUBJECTS = [
    "photosynthesis in desert plants", "the greenhouse effect", "how vaccines train the immune system", "plate tectonics",
    "the water cycle", "nuclear fission", "how a refrigerator moves heat", "antibiotic resistance", "black holes",
    "the Doppler effect", "how batteries store energy", "the structure of DNA", "ocean tides", "superconductivity",
    "how GPS finds a position", "the speed of sound in different materials", "enzymes", "radioactive half-life",
    "how an electric motor turns", "the carbon cycle", "natural selection", "how lenses focus light", "static electricity",
    "compound interest as exponential growth", "entropy", "how a transistor switches", "the periodic table's layout",
    "why the sky is blue", "how bridges carry load", "public-key encryption", "how noise-cancelling headphones work",
    "the human circulatory system", "volcanic eruptions", "how solar panels make electricity", "cloud formation",
    "the placebo effect", "how a compiler turns code into machine instructions", "prime numbers in cryptography",
    "magnetism", "how airplanes stay in the air", "the nitrogen cycle", "sleep and memory", "earthquakes and seismic waves",
    "how a search engine ranks pages", "lithium-ion battery ageing", "the immune response to a cold", "ocean acidification",
    "how 3D printers build objects", "the life cycle of a star", "how noise is measured in decibels"]
_STEM_FRAMES = [
    "Walk me through {t} step by step: what happens, and why?", "What is a common misconception about {t}, and what is the truth?",
    "Explain {t} with the help of an everyday analogy.", "What would a curious twelve-year-old need to know about {t}?",
    "Describe {t} and one experiment that demonstrates it.", "What are the key terms someone must learn to understand {t}?",
    "Give a clear explanation of {t} for a first-year student, with one worked example.",
    "Why do scientists care about {t}? Give two practical applications.",
    "What questions about {t} are still open or debated?", "Explain {t} in five short bullet points."]
_STEM_PAIRS = [
    ("weather", "climate"), ("speed", "velocity"), ("a virus", "a bacterium"), ("mass", "weight"), ("RAM", "storage"),
    ("an atom", "a molecule"), ("heat", "temperature"), ("AC current", "DC current"), ("mitosis", "meiosis"),
    ("a comet", "an asteroid"), ("accuracy", "precision"), ("correlation", "causation"), ("TCP", "UDP"),
    ("an acid", "a base"), ("kinetic energy", "potential energy"), ("a compiler", "an interpreter"),
    ("renewable energy", "fossil fuels"), ("a gene", "a chromosome"), ("series circuits", "parallel circuits")]

_HUM_SUBJECTS = [
    "the invention of the printing press", "the Silk Road", "the French Revolution", "the Renaissance in Florence",
    "the fall of the Berlin Wall", "the Industrial Revolution in Britain", "ancient Athenian democracy",
    "the Meiji Restoration", "the abolition of slavery", "the Marshall Plan", "the spread of the Black Death",
    "the Harlem Renaissance", "Impressionist painting", "Stoic philosophy", "utilitarianism", "the Magna Carta",
    "the Reformation", "the rise of the Roman Empire", "the Mali Empire", "the Cold War space race",
    "the invention of writing in Mesopotamia", "the Enlightenment", "existentialism", "the Bauhaus movement",
    "the history of the Olympic Games", "the women's suffrage movement", "the Ottoman Empire", "the Great Depression",
    "the origins of jazz", "Greek tragedy", "the Gothic cathedral", "the history of coffee houses",
    "the social contract in political philosophy", "the history of the postal service", "supply and demand",
    "inflation and its causes", "the tragedy of the commons", "free speech and its limits", "the role of museums",
    "the Haitian Revolution", "Confucian ethics", "the Byzantine Empire", "the history of public libraries",
    "the invention of the calendar", "surrealism in art", "the Columbian Exchange", "minimalism in music"]
_HUM_FRAMES = [
    "What caused {t}, and what changed because of it?", "Explain why {t} still matters today.",
    "Describe {t} as a museum guide would, in a few paragraphs.", "What are two different ways historians or scholars interpret {t}?",
    "Write a short explainer on {t} for a general reader.", "Which three people or ideas are most important to understand {t}? Explain briefly.",
    "What is commonly misunderstood about {t}?", "Give a timeline of the key moments of {t}.",
    "How would you teach {t} in a single school lesson? Outline the lesson.",
    "Summarise the strongest arguments for and against the legacy of {t}."]

_WRITING_FORMS = ["an opinion column", "a short speech", "a personal essay", "a story of about 300 words",
                  "a poem with four stanzas", "a motivational letter", "a travel guide entry", "a short mystery scene",
                  "a fable with a moral", "a product announcement", "a wedding toast", "a farewell message to a colleague",
                  "a podcast introduction", "a fairy tale for bedtime", "a dialogue between two old friends"]
_WRITING_SUBJECTS = [
    "why everyone should learn to cook one dish well", "a town that wakes up with no electricity", "the joy of getting lost",
    "a teacher who changed your life", "the last bookshop in a city", "working from a cabin in the woods",
    "a robot that wants to become a gardener", "why slow travel beats flying", "a dog that rides the subway",
    "learning a musical instrument at sixty", "a summer job at an ice-cream stand", "the importance of boredom",
    "a time capsule opened after fifty years", "a detective who solves crimes by smell", "the first colony on Mars",
    "why cities need more trees", "a lighthouse that talks", "a family recipe that nobody can get right",
    "a festival of kites", "a friendship between a child and an old fisherman", "a day without a smartphone",
    "a village that votes on everything", "the courage to change careers", "an unexpected letter from a stranger"]
_WRITING_CONSTRAINTS = ["", " Keep it under 250 words.", " Use vivid sensory details.", " Make it funny.",
                        " End with a twist.", " Write it in the first person.", " Give it a title.",
                        " Use simple language.", " Make the tone hopeful."]

_PERSONAS = ["a ship's cook on a long voyage", "a time traveller from the year 2300", "a grumpy but kind librarian",
             "a famous chef judging a cooking contest", "a lighthouse keeper", "a tour guide in ancient Rome",
             "a pirate captain who is afraid of water", "an enthusiastic science teacher", "a wise old owl",
             "a job interviewer at a tech company", "a medieval innkeeper", "a sports commentator at a snail race",
             "a therapist for cartoon characters", "a spaceship's computer", "a personal stylist",
             "a city mayor during a heatwave", "a park ranger giving safety advice", "a radio DJ taking calls at night",
             "a dragon who guards a library", "a detective interviewing a witness"]
_SITUATIONS = ["A visitor asks you for advice about their first week in a new city.",
               "Introduce yourself and explain what a normal day looks like for you.",
               "Someone complains that your service was too slow. Respond in character.",
               "Give a short speech to welcome a group of newcomers.",
               "A child asks you why your job is important. Answer in character.",
               "Describe the most surprising thing that happened to you this year.",
               "Convince a sceptical customer to try something new.",
               "Explain the three rules everyone must follow in your workplace.",
               "You have just received some unexpected good news. React and tell me about it.",
               "Answer my question: what is the secret to doing your job well?"]

_PUZZLES = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops definitely lazzies? Explain.",
    "A bat and a ball cost {a} dollars and 10 cents together. The bat costs {a} dollar(s) more than the ball. How much does the ball cost?",
    "You have {n} identical-looking balls and one is heavier. What is the fewest number of weighings on a balance scale needed to find it? Explain the strategy.",
    "In a line of {n} people, {name} is {k}th from the front. What position is {name} from the back?",
    "A snail climbs {a} metres up a {h}-metre wall each day and slides back 1 metre each night. On which day does it reach the top?",
    "If it takes {a} machines {a} minutes to make {a} widgets, how long would {n} machines take to make {n} widgets?",
    "Which is the odd one out: {w}? Explain your choice, and mention if more than one answer could be defended.",
    "Someone says: '{claim}' Identify the flaw in this reasoning.",
    "A {colour} cube is cut into {c} smaller equal cubes ({k} along each edge). How many small cubes have paint on exactly two faces?",
    "{name} is looking at a photograph and says: 'Brothers and sisters I have none, but that man's father is my father's son.' Who is in the photograph?"]
_ODD = ["apple, banana, carrot, cherry", "violin, trumpet, cello, harp", "Mercury, Venus, Moon, Mars",
        "square, triangle, circle, cube", "Paris, Madrid, Sydney, Rome", "copper, iron, plastic, gold",
        "eagle, penguin, sparrow, bat", "2, 3, 9, 11"]
_CLAIMS = ["Every time I wash my car it rains, so washing my car causes rain.",
           "Most successful people wake up early, so waking up early makes you successful.",
           "This medicine must work because my neighbour took it and got better.",
           "Nobody has proven that ghosts don't exist, so they must exist.",
           "We can't ban cars in the centre, because then nobody could ever travel anywhere.",
           "The new manager started in May and sales fell in June, so the manager is to blame."]

_NAMES = ["Ada", "Bilal", "Carmen", "Dev", "Eun-ji", "Felix", "Gosia", "Hamid", "Isla", "Jomo", "Kiri", "Luca", "Maren",
          "Nikhil", "Olu", "Paola", "Rui", "Saoirse", "Tomasz", "Uma", "Vera", "Wilhelm", "Ximena", "Yusuf"]
_PLACES = ["room 204", "the main hall", "the Riverside office", "the library annex", "the north car park", "studio B",
           "the rooftop terrace", "the east lab", "the cafeteria"]
_ITEMS = ["printer paper", "coffee beans", "safety gloves", "USB cables", "notebooks", "cleaning spray", "batteries",
          "whiteboard markers", "paper cups", "extension leads"]


def _time(rng: random.Random) -> str:
    return f"{rng.randint(8, 18)}:{rng.choice(['00', '15', '30', '45'])}"


def _note(rng: random.Random) -> tuple[str, str]:
    """A short informal text holding several records, and the fields to pull out of it."""
    kind = rng.randrange(4)
    names = rng.sample(_NAMES, 3)
    if kind == 0:
        parts = [f"{n} will present in {p} at {_time(rng)}" for n, p in zip(names, rng.sample(_PLACES, 3))]
        return ("Hi all, quick update for tomorrow: " + "; ".join(parts) + ". Please bring your laptops. Thanks!",
                "presenter, room and time")
    if kind == 1:
        parts = [f"{rng.randint(2, 40)} boxes of {i} at ${rng.randint(3, 60)} a box" for i in rng.sample(_ITEMS, 3)]
        return (f"Hello {names[0]}, as discussed we ordered " + ", ".join(parts) + f". Delivery is expected on the "
                f"{rng.randint(2, 28)}th. Best, {names[1]}", "item, quantity and unit price")
    if kind == 2:
        parts = [f"{n} ran {rng.randint(3, 21)} km in {rng.randint(15, 120)} minutes" for n in names]
        return "Club results from Sunday: " + ", while ".join(parts) + ". Great effort everyone!", "runner, distance and time"
    parts = [f"{n} ({rng.randint(19, 67)}) moved from {a} to {b}" for n, a, b in
             zip(names, rng.sample(["Lyon", "Accra", "Busan", "Perth", "Quito", "Graz", "Turku"], 3),
                 rng.sample(["Oslo", "Lima", "Pune", "Cork", "Fez", "Kobe", "Split"], 3))]
    return "Neighbourhood newsletter: this month " + "; ".join(parts) + ". Say hello if you see them!", "name, age, origin and new city"


def _stem(rng: random.Random) -> str:
    if rng.random() < 0.25:
        a, b = rng.choice(_STEM_PAIRS)
        return f"What is the difference between {a} and {b}? Give an example of each."
    return rng.choice(_STEM_FRAMES).format(t=rng.choice(_STEM_SUBJECTS))


def _humanities(rng: random.Random) -> str:
    return rng.choice(_HUM_FRAMES).format(t=rng.choice(_HUM_SUBJECTS))


def _writing(rng: random.Random) -> str:
    return f"Write {rng.choice(_WRITING_FORMS)} about {rng.choice(_WRITING_SUBJECTS)}.{rng.choice(_WRITING_CONSTRAINTS)}"


def _roleplay(rng: random.Random) -> str:
    return f"Act as {rng.choice(_PERSONAS)} and stay in character. {rng.choice(_SITUATIONS)}"


def _reasoning(rng: random.Random) -> str:
    k = rng.randint(2, 4)
    return rng.choice(_PUZZLES).format(a=rng.randint(1, 3), n=rng.randint(5, 12), k=k, name=rng.choice(_NAMES),
                                       h=rng.randint(6, 15), w=rng.choice(_ODD), claim=rng.choice(_CLAIMS),
                                       colour=rng.choice(["red", "blue", "green"]), c=k ** 3)


def _extraction(rng: random.Random) -> str:
    text, fields = _note(rng)
    ask = rng.choice(["List the {f} of every entry", "Extract the {f} mentioned", "Pull out the {f} for each person or item"])
    fmt = rng.choice([" as JSON.", " as a table.", " as bullet points.", ", then say which entry is largest."])
    return f"{ask.format(f=fields)}{fmt}\n\n{text}"


def _math(rng: random.Random) -> str:
    r = rng.randint
    return rng.choice([
        f"A recipe for {r(2, 6)} people needs {r(150, 600)} g of flour. How much flour is needed for {r(7, 15)} people?",
        f"A shirt costs ${r(20, 80)} after a {r(10, 40)}% discount. What was the original price? Show the calculation.",
        f"What is {r(12, 99)}% of {r(150, 2000)}? Then explain a quick way to estimate it mentally.",
        f"A rectangle has a perimeter of {2 * r(10, 40)} cm and one side of {r(3, 9)} cm. What is its area?",
        f"Convert {r(2, 30)} miles per hour to metres per second, showing each step.",
        f"A bag has {r(2, 8)} red and {r(2, 8)} green marbles. Two are drawn without replacement. What is the probability both are red?"])


def _coding(rng: random.Random) -> str:
    lang = rng.choice(["Python", "JavaScript", "Go", "Rust", "Java", "C#"])
    return rng.choice([
        f"Explain the difference between a list and a dictionary, with short {lang} examples.",
        f"What does recursion mean in programming? Show a small {lang} example and explain when to avoid it.",
        f"Write a {lang} program that counts how often each word appears in a text file and prints the top ten.",
        f"How should I handle errors when reading a file in {lang}? Give an example.",
        f"Write unit tests in {lang} for a function that checks whether a string is a palindrome.",
        f"Explain what Big-O notation means, using two small {lang} functions as examples."])


_SHARE = {"stem": (_stem, 100), "humanities": (_humanities, 100), "extraction": (_extraction, 80),
          "writing": (_writing, 70), "roleplay": (_roleplay, 60), "reasoning": (_reasoning, 50),
          "math": (_math, 20), "coding": (_coding, 20)}

_FOLLOW_UPS = ["Can you expand on the most important point?", "Summarise your answer in one sentence.",
               "Give me three more examples.", "What would someone who disagrees say?", "Put the key facts in a table.",
               "Explain it again, but much more simply.", "What should I read or try next to learn more?",
               "Which part of this do people usually get wrong?", "Now write it in a more formal style."]


def open_requests(seed: int = 2) -> list[Request]:
    """500 distinct requests as (turns, category), in a fixed shuffled order; about 35 % carry a follow-up."""
    return distinct_requests(random.Random(seed), _SHARE, lambda cat: _FOLLOW_UPS, 0.35)
