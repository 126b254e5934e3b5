"""The fourth tier of the built-in prompt set: a wider spread of subjects and ways of asking.

Heads trained on tiers 1-3 still do worst on open explanations, extraction from prose, and writing
and role-play, and the measured gain from tier 3 said that more varied data is the lever. This tier
asks about subjects none of the other tiers names (everyday science, technology, health, nature,
economics, law, art, religion, geography) with frames none of them uses (a question from a reader,
an interview answer, a checklist, a myth to correct, a lesson plan, a debate brief), extraction from
records of other shapes (minutes, invoices, reviews, timetables, logs), writing in other forms and
role-play in other situations, plus reasoning, arithmetic and programming requests with random
numbers and names. Composition is seeded and deterministic; a test checks that no 6-word span is
shared with MT-Bench.
"""

from __future__ import annotations

import random

from .prompts_detailed import Request, distinct_requests

_SCIENCE = [
    "how soap removes grease", "why bread rises", "how a microwave oven heats food", "why ice floats",
    "how fireflies make light", "how touchscreens sense a finger", "why onions make people cry", "how a heat pump works",
    "how coral reefs form", "why leaves change colour in autumn", "how a rainbow forms", "how a vaccine is tested",
    "how the ear turns sound into signals", "why metal feels colder than wood", "how a nuclear reactor is cooled",
    "how wind turbines make electricity", "how birds navigate when they migrate", "how a camera sensor records light",
    "why the Moon has phases", "how a hurricane forms", "how caffeine affects the body", "how an MRI scanner works",
    "how the internet routes a message", "how glass is made", "why some materials conduct electricity",
    "how a fridge magnet sticks", "how tsunamis travel", "how the liver cleans the blood", "how a seed knows which way is up",
    "why the ocean is salty", "how a rocket reaches orbit", "how bees make honey", "how a fever fights infection",
    "how concrete hardens", "how a smartphone battery charges", "how yeast ferments sugar", "why we have seasons",
    "how a bicycle stays upright", "how a thermostat keeps a room warm", "how a QR code stores data",
    "how the kidneys balance water", "how an LED makes light", "how weather forecasts are made", "why stars twinkle",
    "how a vaccine's cold chain works", "how desalination makes drinking water", "how muscles grow after exercise",
    "how fingerprints are compared", "how a pendulum clock keeps time", "how recycling sorts plastics"]
_SCIENCE_FRAMES = [
    "A reader writes in: 'I have always wondered about {t}.' Answer the reader in a friendly way.",
    "Correct this myth and explain what really happens: most people misunderstand {t}.",
    "Prepare a one-page study sheet on {t}: key idea, how it works, a diagram described in words, and a quiz question.",
    "In plain language, explain {t}, then say what would happen if one part of the process stopped.",
    "As a science journalist, write a short paragraph that explains {t} to newspaper readers.",
    "List the main steps of {t} in order, with one sentence on each step.",
    "Explain {t} twice: once for a child and once for an engineer.",
    "What is the physics, chemistry or biology behind {t}? Keep it short and precise.",
    "Design a simple home or classroom demonstration that shows {t}, with safety notes.",
    "Give a short history of how people came to understand {t}.",
    "What numbers or measurements help to understand {t}? Give typical values.",
    "Answer in a question-and-answer format: five questions a student might ask about {t}, each with an answer."]

_SOCIETY = [
    "the history of the bicycle", "the invention of paper money", "the history of maps", "the rise of public schools",
    "the Hanseatic League", "the history of the piano", "the Aztec capital Tenochtitlan", "the Grand Canal of China",
    "the history of vaccination campaigns", "the birth of the modern novel", "the Dutch Golden Age", "the Inca road system",
    "the invention of photography", "the history of chess", "the building of the pyramids at Giza",
    "the history of the weekend", "the Scientific Revolution", "the Indian independence movement",
    "the history of the stock market", "the rise of the city-state of Venice", "the history of trade unions",
    "the origins of the Red Cross", "the development of sign languages", "the history of tea", "Baroque music",
    "the Arts and Crafts movement", "the history of the railway timetable", "the Phoenician alphabet",
    "the history of democracy in Iceland", "the role of monasteries in medieval Europe", "the Mughal Empire",
    "the history of the encyclopedia", "opportunity cost", "the role of central banks", "comparative advantage in trade",
    "the ethics of lying", "the philosophy of Epicurus", "virtue ethics", "the idea of human rights",
    "the separation of powers", "the history of copyright", "the role of a free press", "urbanisation in the 20th century",
    "the history of the calendar reform of 1582", "the spread of Buddhism along trade routes", "the history of theatre masks",
    "the sociology of fashion", "why languages change over time", "the history of weights and measures",
    "folk tales and what they teach"]
_SOCIETY_FRAMES = [
    "Write a short encyclopedia-style entry on {t}.", "How did {t} affect the daily lives of ordinary people?",
    "Prepare a five-minute talk on {t} for a history club, with a strong opening line.",
    "Explain {t} by comparing it with something in the modern world.",
    "What are the main causes and consequences of {t}? Use two short lists.",
    "Write a debate brief on {t}: the question, two positions, and the best evidence for each.",
    "If you could interview someone involved in {t}, what five questions would you ask, and why?",
    "Explain the key vocabulary a student needs to discuss {t}.",
    "Give three surprising facts about {t} and explain why each one matters.",
    "Describe {t} in about 200 words, then suggest a book or kind of source to learn more.",
    "What lessons does {t} hold for today? Give a balanced answer.",
    "Outline an essay on {t}: thesis, three body paragraphs, and conclusion."]

_GEOGRAPHY = ["Iceland", "the Amazon basin", "the Sahara", "Mongolia", "the Alps", "New Zealand", "the Nile delta",
              "Patagonia", "the Himalayas", "Madagascar", "the Great Lakes", "the Mekong river", "Greenland",
              "the Andes", "the Mediterranean coast", "Siberia", "the Caribbean islands", "the Scottish Highlands"]
_GEOGRAPHY_FRAMES = [
    "Describe the climate, landscape and people of {t} for a geography lesson.",
    "How has the geography of {t} shaped the way people live there?",
    "What environmental challenges does {t} face, and what is being done about them?",
    "Plan a two-week educational trip to {t}: what to see and what to learn at each stop."]

_RECORD_NAMES = ["Abebe", "Brigid", "Chen", "Dagny", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jana", "Kwame", "Lea",
                 "Mateo", "Noor", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Ulla", "Vikram", "Wen", "Zara"]
_PRODUCTS = ["a blender", "wireless earbuds", "a camping tent", "a desk lamp", "running shoes", "a coffee grinder",
             "a robot vacuum", "a yoga mat", "an e-reader", "a rice cooker", "a backpack", "a smart watch"]
_CITIES = ["Bergen", "Cusco", "Daegu", "Hobart", "Izmir", "Jaipur", "Krakow", "Leeds", "Mombasa", "Nantes", "Porto",
           "Recife", "Tampere", "Valencia"]


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice(['05', '10', '20', '35', '40', '50'])}"


def _record(rng: random.Random) -> tuple[str, str]:
    """A short text of another shape than tier 3's notes, and the fields to pull out of it."""
    kind = rng.randrange(6)
    names = rng.sample(_RECORD_NAMES, 3)
    if kind == 0:
        acts = rng.sample(["update the budget", "book the venue", "call the supplier", "draft the newsletter",
                           "fix the website form", "order new chairs", "plan the training day"], 3)
        parts = [f"{n} agreed to {a} by {rng.choice(['Monday', 'Wednesday', 'Friday', 'next week', 'the 15th'])}"
                 for n, a in zip(names, acts)]
        return ("Minutes of the team meeting. Present: " + ", ".join(names) + ". Actions: " + "; ".join(parts)
                + ". Next meeting in two weeks.", "person, task and deadline")
    if kind == 1:
        lines = [f"{rng.randint(1, 12)} x {item} at {rng.randint(2, 90)}.{rng.choice(['00', '50', '99'])} EUR"
                 for item in rng.sample(["desk chairs", "monitors", "keyboards", "cables", "lamps", "headsets",
                                         "notebooks", "plants"], 3)]
        return (f"Invoice no. {rng.randint(1000, 9999)} from {rng.choice(['Nordlicht Supplies', 'Kestrel Office', 'Bluebay Trading'])}: "
                + "; ".join(lines) + f". Payment due within {rng.choice([14, 30, 60])} days.",
                "item, quantity and unit price, plus the total")
    if kind == 2:
        revs = [f"{n} gave {p} {rng.randint(1, 5)} stars and wrote that it was "
                f"{rng.choice(['great value', 'too noisy', 'easy to set up', 'broken after a week', 'smaller than expected'])}"
                for n, p in zip(names, rng.sample(_PRODUCTS, 3))]
        return "Customer reviews this week: " + ". ".join(revs) + ".", "reviewer, product, rating and main comment"
    if kind == 3:
        legs = [f"the {_clock(rng)} train from {a} reaches {b} at {_clock(rng)}"
                for a, b in zip(rng.sample(_CITIES, 3), rng.sample(_CITIES, 3))]
        return "Travel notice: " + "; ".join(legs) + ". Seats can be reserved online.", "departure city, arrival city and times"
    if kind == 4:
        evts = [f"[{_clock(rng)}] {rng.choice(['ERROR', 'WARN', 'INFO'])} {s}: "
                f"{rng.choice(['disk 91% full', 'request took 3.2 s', 'user login failed', 'backup finished', 'cache cleared'])}"
                for s in rng.sample(["web-1", "db-main", "auth", "worker-3", "mail"], 3)]
        return "Server log excerpt:\n" + "\n".join(evts), "time, level, service and message"
    dishes = [f"{n} brought {d} ({rng.choice(['vegan', 'contains nuts', 'gluten-free', 'contains dairy'])})"
              for n, d in zip(names, rng.sample(["lentil soup", "apple pie", "spring rolls", "potato salad", "flatbread",
                                                 "fruit salad", "lasagne"], 3))]
    return "Potluck sign-up sheet: " + "; ".join(dishes) + ".", "person, dish and dietary note"


_WIDE_FORMS = ["a blog post", "a diary entry", "a short radio script", "a limerick", "a haiku sequence",
               "a letter to your future self", "a children's picture-book text", "a newspaper feature opening",
               "a thank-you note", "a short horror story", "a product description", "a eulogy for a beloved old car",
               "a campaign slogan and a paragraph explaining it", "a short science-fiction story", "a recipe written as a poem"]
_WIDE_SUBJECTS = [
    "the first snow of the year", "a neighbour who plants flowers for the whole street", "moving to a new country",
    "an old map found in an attic", "a city bus driver's longest day", "learning to swim as an adult",
    "the sound of rain on a tin roof", "a lost key that changes everything", "a chess match in a park",
    "a beekeeper and her bees", "a night train across the mountains", "the smell of a bakery at dawn",
    "the last day of school", "a river that changes course", "a repair café where people fix old things",
    "a stray cat that adopts an office", "climbing a mountain with a grandparent", "a power cut during a storm",
    "a market that opens only at midnight", "an inventor whose inventions never work", "a message in a bottle",
    "the quiet hour before a big exam", "two strangers sharing an umbrella", "a garden on a city balcony"]
_WIDE_CONSTRAINTS = ["", " Keep it short.", " Use a calm, reflective tone.", " Include some dialogue.",
                     " Start with a question.", " Use the present tense.", " Aim it at teenagers.",
                     " Make every sentence count.", " Add a surprising ending."]

_ROLES = ["a hotel concierge", "a museum night guard", "a retired astronaut", "a bakery owner at 5 a.m.",
          "a flight attendant on a delayed flight", "a chess grandmaster giving lessons", "a zookeeper",
          "a librarian in the year 3000", "a mountain guide", "a knight who has lost his horse",
          "a fortune teller who only predicts the weather", "a customer-support agent for a time machine",
          "a ghost who haunts a bookshop", "a football coach at half-time", "a stage magician", "a lighthouse cat",
          "an art critic at a children's exhibition", "a train conductor", "a marine biologist on a research ship",
          "a gardener who talks to plants"]
_SCENES = ["A guest asks what they should not miss today. Answer in character.",
           "Tell me about the strangest request you have ever received.",
           "I am new here and nervous. Give me your best advice, in character.",
           "Describe your workplace so vividly that I can picture it.",
           "Someone has made a serious mistake. Calm them down and help them fix it.",
           "Explain your job to a visitor from another planet.",
           "A journalist asks you what has changed most in your line of work. Answer.",
           "Give me a short pep talk before my big day.",
           "Tell a short story about the proudest moment of your career.",
           "A critic says your work is unimportant. Reply politely but firmly."]

_RIDDLES = [
    "{a} friends shake hands with each other exactly once. How many handshakes are there? Explain the counting.",
    "A clock shows {h}:00. What is the angle between the hour and minute hands? What about at {h}:30?",
    "{name} is older than {other}, and {other} is older than {third}. Who is the youngest, and how do you know?",
    "If today is {day}, what day of the week will it be in {n} days? Show the reasoning.",
    "A farmer has {a} sheep; all but {k} run away. How many are left? Explain why people often get this wrong.",
    "Three boxes are labelled 'apples', 'oranges' and 'mixed', and every label is wrong. You may take one fruit from "
    "one box. How do you relabel all the boxes correctly?",
    "In a race, {name} overtakes the person in {ordinal} place. What place is {name} in now?",
    "A number doubled and then increased by {k} gives {total}. What is the number? Solve it two ways.",
    "Is this argument valid? 'All {x} can fly. {name}'s pet is a {x_one}. So it can fly.' Explain premises and validity.",
    "There are {n} light switches outside a closed room and one bulb inside. How can you find which switch "
    "controls the bulb if you may enter the room only once?"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_CREATURES = [("penguins", "penguin"), ("birds", "bird"), ("insects", "insect"), ("bats", "bat")]


def _science(rng: random.Random) -> str:
    return rng.choice(_SCIENCE_FRAMES).format(t=rng.choice(_SCIENCE))


def _society(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(_GEOGRAPHY_FRAMES).format(t=rng.choice(_GEOGRAPHY))
    return rng.choice(_SOCIETY_FRAMES).format(t=rng.choice(_SOCIETY))


def _extract(rng: random.Random) -> str:
    text, fields = _record(rng)
    ask = rng.choice(["Read the text below and list the {f}", "From this text, extract the {f}",
                      "Turn the following into structured data with the {f}", "Find the {f} in the text below"])
    fmt = rng.choice([" in a JSON array.", " as a Markdown table.", " as a CSV with a header row.",
                      ", one line per entry.", ", and then write a one-sentence summary."])
    return f"{ask.format(f=fields)}{fmt}\n\n{text}"


def _write(rng: random.Random) -> str:
    return f"Write {rng.choice(_WIDE_FORMS)} about {rng.choice(_WIDE_SUBJECTS)}.{rng.choice(_WIDE_CONSTRAINTS)}"


def _role(rng: random.Random) -> str:
    return f"Pretend to be {rng.choice(_ROLES)}. {rng.choice(_SCENES)}"


def _riddle(rng: random.Random) -> str:
    name, other, third = rng.sample(_RECORD_NAMES, 3)
    k, x = rng.randint(3, 9), rng.choice(_CREATURES)
    return rng.choice(_RIDDLES).format(
        a=rng.randint(4, 15), h=rng.randint(1, 11), name=name, other=other, third=third, day=rng.choice(_DAYS),
        n=rng.randint(10, 400), k=k, total=2 * rng.randint(5, 60) + k, x=x[0], x_one=x[1], ordinal=rng.choice(
            ["second", "third", "last"]))


def _arithmetic(rng: random.Random) -> str:
    r = rng.randint
    return rng.choice([
        f"A train travels {r(60, 400)} km in {r(2, 6)} hours and then {r(50, 300)} km in {r(1, 4)} hours. What is its "
        "average speed for the whole trip?",
        f"Solve the equation {r(2, 9)}x + {r(1, 30)} = {r(31, 120)} and check the answer.",
        f"A savings account pays {r(2, 6)}% interest a year, compounded yearly. How much do {r(5, 50) * 100} dollars "
        f"become after {r(2, 5)} years?",
        f"Find the mean, median and mode of these numbers: {', '.join(str(r(1, 20)) for _ in range(7))}.",
        f"A circle has a radius of {r(2, 15)} cm. Find its circumference and area, to two decimal places.",
        f"Two dice are rolled. What is the probability that the sum is {r(3, 11)}? List the outcomes.",
        f"A phone plan costs {r(5, 20)} dollars a month plus {r(2, 9)} cents a minute. How many minutes make the bill "
        f"{r(25, 60)} dollars?",
        f"What is the least common multiple and the greatest common divisor of {r(6, 40)} and {r(41, 120)}?"])


def _programming(rng: random.Random) -> str:
    lang = rng.choice(["Python", "TypeScript", "Kotlin", "C++", "Ruby", "Swift", "PHP"])
    return rng.choice([
        f"Write a {lang} function that returns the n-th Fibonacci number iteratively, and explain its complexity.",
        f"Show how to read a CSV file and compute the average of one column in {lang}.",
        f"Explain what a hash map is and how collisions are handled, with a small {lang} example.",
        f"Write a {lang} function that checks whether two strings are anagrams of each other. Add tests.",
        f"What is the difference between a stack and a queue? Implement both briefly in {lang}.",
        f"Review this idea: storing passwords in plain text in a {lang} web app. What should be done instead, and how?",
        f"Write a {lang} function that merges two sorted lists into one sorted list.",
        f"Explain how binary search works and write it in {lang}, including the edge cases.",
        f"Write a small {lang} class for a bank account with deposit, withdraw and a balance check.",
        f"How do you remove duplicates from a list in {lang} while keeping the order? Show two ways.",
        f"Explain what an off-by-one error is, with a buggy {lang} loop and its fix.",
        f"Write a {lang} function that validates an e-mail address roughly, and say what it misses.",
        f"Explain immutability and why it helps, with {lang} examples.",
        f"Write a {lang} program that prints a multiplication table from 1 to 10, neatly aligned.",
        f"How would you measure how long a piece of {lang} code takes to run? Give an example.",
        f"Write a {lang} function that reverses the words in a sentence but not the letters."])


_SHARE = {"stem": (_science, 200), "humanities": (_society, 200), "extraction": (_extract, 170),
          "writing": (_write, 180), "roleplay": (_role, 150), "reasoning": (_riddle, 100),
          "math": (_arithmetic, 100), "coding": (_programming, 100)}

_FOLLOW_UPS = ["Good. Now give a short summary for someone in a hurry.", "Can you add one real-world example?",
               "What is the most common mistake people make here?", "Rewrite the answer as a list of key points.",
               "Please make it more detailed.", "Now explain it from a different point of view.",
               "What question would you ask next, and what is its answer?", "Make it friendlier and less formal."]


def wide_requests(seed: int = 3) -> list[Request]:
    """1,200 distinct requests as (turns, category), in a fixed shuffled order; about 35 % carry a
    follow-up."""
    return distinct_requests(random.Random(seed), _SHARE, lambda cat: _FOLLOW_UPS, 0.35)
