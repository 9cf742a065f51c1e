"""Held-out evaluation prompts for the traffic-mix benchmarks (scripts/bench_traffic.py, scripts/bench_vocab.py).

Every prompt here was written for these benchmarks, by hand, and is used for EVALUATION ONLY: no
bootstrap, distillation or vocabulary choice may train on them (they are not part of any source in
training/prompts.py, and nothing under training/ imports this module). The maths problems are new word
problems, not copied or paraphrased from GSM8K.

Six categories of 12 prompts each, varied in length and style, to look like a general assistant's traffic:

    maths       word problems (short one-step to multi-step, some asking for the working)
    science     explanations and conceptual questions (physics, chemistry, biology, earth science)
    code        Python questions and small tasks, some with code to read or fix
    everyday    practical questions (cooking, travel, home, money, health habits)
    writing     emails, stories, summaries of a given passage, rewrites
    multiturn   2-3 turn conversations as message lists, with realistic earlier assistant turns

One-turn prompts are plain strings (the user message); multi-turn prompts are lists of
{"role", "content"} messages ending with a user turn.

    from scripts.traffic_prompts import prompt_ids
    ids = prompt_ids(tokenizer)                 # {category: [[token ids], ...]} with the chat template
    ids = prompt_ids(tokenizer, ["code"], n=2)  # first 2 code prompts only

    .venv/bin/python scripts/traffic_prompts.py   # prints counts and token lengths per category
"""
from __future__ import annotations

from typing import Iterable, Union

Prompt = Union[str, list]   # a user message, or a list of {"role", "content"} messages

MATHS: list[str] = [
    "A bakery sells muffins for $2.50 each or a box of 6 for $13. How much does Priya save by buying "
    "two boxes instead of 12 single muffins?",
    "What is 15% of 360?",
    "A train leaves a station at 9:40 am and travels 228 km at an average speed of 76 km/h. At what time "
    "does it arrive? Show your working.",
    "Marco is tiling a bathroom floor that measures 2.4 m by 1.8 m. Each square tile is 30 cm on a side "
    "and tiles come in packs of 10. He wants 10% extra for breakage, rounded up to whole tiles. How many "
    "packs does he need to buy?",
    "A phone plan costs $18 a month plus $0.05 per text after the first 200 texts. In March, Lena sent "
    "347 texts. What was her bill?",
    "The ages of three siblings add up to 41. The oldest is twice as old as the youngest, and the middle "
    "one is 5 years older than the youngest. How old is each sibling?",
    "If a recipe needs 3/4 cup of sugar for 12 cookies, how much sugar do I need for 30 cookies?",
    "A school library had 1,250 books. In September it gave away 8% of them, then it received a donation "
    "of 175 books in October. In November, 1 in every 20 books was checked out at the same time. How "
    "many books were on the shelves in November? Explain each step.",
    "Two cyclists start 54 km apart and ride towards each other, one at 14 km/h and the other at 22 km/h. "
    "How long until they meet?",
    "A jacket is marked down 25%, and then a further 10% is taken off the sale price at the till. Is that "
    "the same as a 35% discount? What is the final price of a $120 jacket?",
    "Sam saves $15 in the first week and each week saves $3 more than the week before. How much has he "
    "saved in total after 10 weeks?",
    "A rectangular garden is 3 m longer than it is wide, and its perimeter is 46 m. Find its area.",
]

SCIENCE: list[str] = [
    "Why is the sky blue?",
    "Explain the difference between weather and climate in a short paragraph.",
    "How do vaccines train the immune system? Keep it simple enough for a 12-year-old.",
    "What happens to the particles of a substance when it melts? Describe it in terms of energy and forces.",
    "Why do we have seasons on Earth? A lot of people think it is because the Earth is closer to the Sun in "
    "summer. Is that right?",
    "What is the difference between mitosis and meiosis, and why does the body need both?",
    "A ball is dropped from a tall building. Ignoring air resistance, how fast is it going after 3 seconds, "
    "and how far has it fallen?",
    "Explain what an acid and a base are, and what happens when you mix them.",
    "How does a plant turn sunlight into food? Mention where in the cell it happens.",
    "Why does ice float on water when most solids sink in their own liquid?",
    "What causes earthquakes, and why are they more common in some parts of the world than others?",
    "Explain in a few sentences how a battery produces an electric current.",
]

CODE: list[str] = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "What is the difference between a list and a tuple in Python?",
    "How do I read a CSV file in Python and print the sum of the values in a column called \"price\"?",
    "Why does this code print the same list twice?\n\n```python\ndef add_item(item, items=[]):\n"
    "    items.append(item)\n    return items\n\nprint(add_item(1))\nprint(add_item(2))\n```",
    "Write a Python function `count_words(text)` that returns a dictionary mapping each word to how many "
    "times it appears. Words should be compared in lower case and punctuation ignored.",
    "Explain what a Python decorator is with a small example.",
    "Fix the bug in this function:\n\n```python\ndef average(numbers):\n    total = 0\n"
    "    for n in numbers:\n        total += n\n    return total / len(numbers) - 1\n```",
    "How can I reverse a list in Python? Show two ways.",
    "Write a function that takes a list of integers and returns the second largest distinct value, or None "
    "if there is none. Include a couple of test cases.",
    "What does `if __name__ == \"__main__\":` do in a Python script?",
    "I have a dictionary `scores = {\"ana\": 82, \"ben\": 95, \"cara\": 78}`. How do I sort the names by "
    "score, highest first?",
    "Write a small Python class `BankAccount` with deposit and withdraw methods. Withdrawing more than the "
    "balance should raise a ValueError.",
]

EVERYDAY: list[str] = [
    "How long should I boil an egg if I want the yolk still a bit runny?",
    "What are some tips for falling asleep faster?",
    "I'm going on a three-day hiking trip in the mountains in autumn. What should I pack?",
    "How do I get a red wine stain out of a light-coloured carpet?",
    "Is it cheaper to run a dishwasher or to wash dishes by hand?",
    "Give me a simple weekly meal plan for a vegetarian on a budget.",
    "My houseplant's leaves are turning yellow. What could be wrong?",
    "How can I save money on groceries without eating worse?",
    "What should I do if my phone gets wet?",
    "I want to start running but I get out of breath after a few minutes. How should I begin?",
    "How do I politely decline an invitation to a friend's party?",
    "What's a good way to keep track of monthly expenses?",
]

WRITING: list[str] = [
    "Write a short email to my manager asking to take next Friday off for a family event.",
    "Write a story of about 150 words about a lighthouse keeper who finds a message in a bottle.",
    "Summarise the following paragraph in two sentences:\n\nThe town council met on Tuesday to discuss "
    "the future of the old railway station, which has been empty for more than a decade. Some members "
    "want to turn it into a community centre with a library and a café, arguing that the town lacks "
    "spaces where people can meet. Others prefer to sell the building to a developer who plans to build "
    "flats, which would bring money into the council's budget and help with the housing shortage. A "
    "decision was postponed until a public consultation has been held in the spring.",
    "Write a polite complaint to an online shop: my order arrived two weeks late and one item was missing.",
    "Write a four-line poem about rain on a city street.",
    "Rewrite this sentence to sound more professional: \"hey, the report's gonna be late cos we're still "
    "waiting on numbers from sales.\"",
    "Write a thank-you note to a neighbour who watered my plants while I was on holiday.",
    "Write the opening paragraph of a mystery novel set in a snowed-in mountain hotel.",
    "Summarise the plot of a story where a young baker enters a national competition, fails in the first "
    "round, and then wins the next year with her grandmother's recipe. Keep it under 60 words.",
    "Write a short product description for a reusable water bottle that keeps drinks cold for 24 hours.",
    "Draft a message to my team announcing that our weekly meeting is moving from Monday to Wednesday at 10 am.",
    "Write a cover letter paragraph for a junior data analyst job, for someone who has just finished a "
    "statistics degree and did an internship at a small marketing firm.",
]


def _chat(*turns: str) -> list[dict]:
    """Alternating user / assistant turns, starting and ending with a user turn."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


MULTITURN: list[list[dict]] = [
    _chat("What's the capital of Australia?",
          "The capital of Australia is Canberra. Many people guess Sydney or Melbourne, but Canberra was "
          "chosen as a compromise between those two cities and became the capital in 1913.",
          "Why was a compromise needed?"),
    _chat("Can you give me a recipe for pancakes?",
          "Sure! You'll need 1 cup of flour, 1 tablespoon of sugar, 2 teaspoons of baking powder, a pinch of "
          "salt, 1 cup of milk, 1 egg and 2 tablespoons of melted butter. Mix the dry ingredients, whisk in "
          "the milk, egg and butter until just combined, and cook ladlefuls on a hot, lightly greased pan "
          "until bubbles form, then flip and cook for another minute.",
          "I don't have any eggs. What can I use instead?"),
    _chat("Write a Python function that returns the factorial of n.",
          "Here is a simple version:\n\n```python\ndef factorial(n):\n    result = 1\n    for i in range(2, "
          "n + 1):\n        result *= i\n    return result\n```\n\nFor n = 0 it returns 1, which is the "
          "usual definition.",
          "Can you make it recursive instead?",
          "Of course:\n\n```python\ndef factorial(n):\n    if n <= 1:\n        return 1\n    return n * "
          "factorial(n - 1)\n```",
          "What happens if I call it with a negative number?"),
    _chat("I have 40 dollars and want to buy notebooks that cost 3.50 each. How many can I buy?",
          "40 / 3.50 is about 11.4, so you can buy 11 notebooks. They would cost 11 x 3.50 = 38.50 dollars, "
          "leaving you 1.50 dollars.",
          "What if there is a 10% discount on the notebooks?"),
    _chat("What's the difference between a virus and a bacterium?",
          "Bacteria are single-celled living organisms that can reproduce on their own; many are harmless or "
          "even helpful. Viruses are much smaller, are not cells, and can only reproduce inside the cells of "
          "another organism. Antibiotics work against bacteria but not against viruses.",
          "So why do doctors sometimes say not to take antibiotics for a cold?"),
    _chat("Help me write a birthday message for my sister.",
          "Happy birthday to the best sister anyone could ask for! Thank you for the laughs, the advice and "
          "for always being there. I hope this year brings you as much joy as you bring everyone around you.",
          "Nice, but make it funnier. She's turning 30.",
          "Happy 30th! Don't worry, you're not old, you're just vintage. Thirty looks great on you, mostly "
          "because I'm standing next to you. Have a wonderful day!",
          "Haha, can you make it a bit shorter so it fits on a card?"),
    _chat("I'm planning a trip to Japan in April. Any tips?",
          "April is cherry blossom season, so it's beautiful but busy. Book hotels early, consider a Japan "
          "Rail Pass if you'll travel between cities, carry some cash because smaller shops may not take "
          "cards, and pick up an IC card like Suica for trains and buses in the cities.",
          "How many days would you spend in Tokyo versus Kyoto?"),
    _chat("Explain what a for loop does in Python.",
          "A for loop runs a block of code once for each item in a sequence. For example, `for name in "
          "['ana', 'ben']: print(name)` prints each name in turn. With `range(5)` you can repeat something "
          "five times, with the variable taking the values 0 to 4.",
          "And what's a while loop? When should I use it instead?"),
    _chat("My tomato plants have brown spots on the lower leaves.",
          "That is often early blight, a common fungal disease. Remove the affected leaves, avoid watering "
          "the leaves (water at the base instead), add mulch so soil doesn't splash up, and give the plants "
          "space for air to circulate.",
          "Will the tomatoes still be safe to eat?",
          "Yes. Early blight affects the leaves and stems; the fruit is safe to eat as long as it looks and "
          "smells normal. Just cut away any soft or damaged parts.",
          "How do I stop it happening again next year?"),
    _chat("Summarise the causes of the First World War in a few sentences.",
          "Historians usually point to four long-term causes: militarism, a system of alliances, imperial "
          "rivalry, and nationalism. The immediate trigger was the assassination of Archduke Franz "
          "Ferdinand of Austria-Hungary in Sarajevo in June 1914, after which the alliances pulled the major "
          "European powers into war within weeks.",
          "Which alliances were there?"),
    _chat("A rectangle has an area of 48 square cm and one side is 6 cm. What is the other side?",
          "The other side is 48 / 6 = 8 cm.",
          "And what is its perimeter?",
          "The perimeter is 2 x (6 + 8) = 28 cm.",
          "If I double both sides, what happens to the area?"),
    _chat("Can you recommend a good book for someone who liked The Hobbit?",
          "If you enjoyed The Hobbit, you might like The Name of the Wind by Patrick Rothfuss, A Wizard of "
          "Earthsea by Ursula K. Le Guin, or, of course, The Lord of the Rings. Earthsea in particular has a "
          "similar sense of adventure and a young hero learning about the world.",
          "I want something shorter. Which of those is the quickest read?"),
]

CATEGORIES: dict[str, list[Prompt]] = {
    "maths": MATHS,
    "science": SCIENCE,
    "code": CODE,
    "everyday": EVERYDAY,
    "writing": WRITING,
    "multiturn": MULTITURN,
}


def messages(prompt: Prompt) -> list[dict]:
    """The chat messages of one prompt (a one-turn prompt becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def traffic_prompts(categories: Iterable[str] | None = None, n: int | None = None) -> dict[str, list[Prompt]]:
    """{category: prompts} for the named categories (default all, in CATEGORIES order), first `n` of each."""
    names = list(categories) if categories is not None else list(CATEGORIES)
    unknown = [c for c in names if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"choose from {', '.join(CATEGORIES)}")
    return {c: list(CATEGORIES[c][:n] if n else CATEGORIES[c]) for c in names}


def prompt_to_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of one prompt through the chat template, with the assistant prefix."""
    ids = tokenizer.apply_chat_template(messages(prompt), add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(i) for i in ids]


def prompt_ids(tokenizer, categories: Iterable[str] | None = None, n: int | None = None) -> dict[str, list[list[int]]]:
    """{category: [token ids of each prompt]} (chat template, assistant prefix), first `n` per category."""
    return {c: [prompt_to_ids(tokenizer, p) for p in ps] for c, ps in traffic_prompts(categories, n).items()}


def _check() -> None:
    for c, ps in CATEGORIES.items():
        assert len(ps) == 12, (c, len(ps))
        for p in ps:
            if not isinstance(p, str):
                assert p and p[-1]["role"] == "user" and 3 <= len(p) <= 5, p
                assert all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(p)), p


_check()


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from serving.models import ensure_default_target, load_tokenizer

    tok = load_tokenizer(ensure_default_target())
    for cat, rows in prompt_ids(tok).items():
        lens = sorted(len(r) for r in rows)
        print(f"{cat:10s} {len(rows):3d} prompts, tokens min {lens[0]} median {lens[len(lens) // 2]} max {lens[-1]}")
