"""Synthetic traffic for the online-learning experiment (scripts/bench_online.py): kinds of request the
bootstrap draft never saw.

The bootstrap (training/draft_builder.py) learns from self-written chat, multi-turn follow-ups, GSM8K,
GPQA, AIME and HumanEval prompts. The categories here are none of those: requests a deployed assistant
gets from an application rather than from a person, each drawn from templates over word lists with a
seeded RNG, so a run of any length sees a stream of distinct prompts (not a list replayed), and two
runs with the same seed see the same stream:

    sql      "write a SQL query" over a small invented schema (tables, columns, conditions vary)
    json     "extract these fields as JSON" from a generated sentence about a person, order or event
    known    the training split of GSM8K and HumanEval (in the bootstrap data): the earlier traffic,
             against which forgetting is measured

    from scripts.online_traffic import PromptStream
    s = PromptStream("sql", seed=0); s.next()   # -> a user message
"""
from __future__ import annotations

import random

CATEGORIES = ("sql", "json", "known")

_TABLES = {
    "orders": (["order_id", "customer_id", "total", "status", "created_at", "country"],
               ["total"], ["status", "country"]),
    "employees": (["id", "name", "department", "salary", "hire_date", "manager_id"],
                  ["salary"], ["department"]),
    "products": (["sku", "name", "category", "price", "stock", "supplier"], ["price", "stock"],
                 ["category", "supplier"]),
    "flights": (["flight_no", "origin", "destination", "departure", "delay_minutes", "airline"],
                ["delay_minutes"], ["origin", "destination", "airline"]),
    "students": (["student_id", "name", "grade", "score", "school", "city"], ["score"], ["grade", "school", "city"]),
    "tickets": (["ticket_id", "priority", "assignee", "opened_at", "resolution_hours", "team"],
                ["resolution_hours"], ["priority", "assignee", "team"]),
    "rentals": (["rental_id", "car_model", "branch", "days", "price_per_day", "customer"],
                ["days", "price_per_day"], ["car_model", "branch"]),
}
_VALUES = ["'open'", "'shipped'", "'Germany'", "'Sales'", "'books'", "'LHR'", "'urgent'", "'Berlin'", "'Lyon'",
           "'Acme'", "'electronics'", "'Engineering'", "'closed'", "'Japan'", "'premium'"]
_AGG = [("average", "AVG"), ("total", "SUM"), ("maximum", "MAX"), ("minimum", "MIN")]


def _sql(rng: random.Random) -> str:
    table = rng.choice(list(_TABLES))
    cols, nums, cats = _TABLES[table]
    num, cat, val, k = rng.choice(nums), rng.choice(cats), rng.choice(_VALUES), rng.randint(3, 20)
    word, _ = rng.choice(_AGG)
    tasks = [
        f"returns the {word} {num} for each {cat}",
        f"lists the {k} rows with the highest {num}",
        f"counts the rows where {cat} is {val}",
        f"returns every {cat} whose {word} {num} is above {rng.randint(10, 900)}",
        f"finds the {cat} values that appear more than {rng.randint(2, 9)} times",
        f"returns all columns for rows where {num} is between {rng.randint(1, 50)} and {rng.randint(60, 500)}, "
        f"newest first",
        f"shows the number of rows and the {word} {num} per {cat}, sorted by the count",
    ]
    schema = f"{table}({', '.join(cols)})"
    style = rng.choice(["Write a SQL query on the table {s} that {t}.",
                        "Given the table {s}, write an SQL query that {t}.",
                        "SQL question: for {s}, give me a query that {t}. Explain it briefly.",
                        "I have a table {s}. How do I write a query that {t}?"])
    return style.format(s=schema, t=rng.choice(tasks))


_FIRST = ["Ana", "Tomas", "Mei", "Olu", "Priya", "Jonas", "Lea", "Karim", "Sofia", "Daniel", "Yuki", "Ines", "Marek"]
_LAST = ["Silva", "Novak", "Chen", "Adeyemi", "Rao", "Berg", "Martin", "Haddad", "Rossi", "Kowalski", "Sato"]
_CITIES = ["Lisbon", "Prague", "Osaka", "Lagos", "Pune", "Oslo", "Lyon", "Cairo", "Turin", "Gdansk", "Quito"]
_ITEMS = ["desk lamp", "running shoes", "coffee grinder", "phone case", "backpack", "monitor", "kettle", "drill"]
_EVENTS = ["team offsite", "product launch", "board meeting", "yoga class", "code review", "wedding", "hackathon"]


def _json(rng: random.Random) -> str:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    city = rng.choice(_CITIES)
    kind = rng.randrange(3)
    if kind == 0:
        text = (f"{name} is {rng.randint(19, 71)} years old, lives in {city} and works as a "
                f"{rng.choice(['nurse', 'teacher', 'pilot', 'chef', 'engineer', 'lawyer', 'farmer'])}.")
        keys = ["name", "age", "city", "job"]
    elif kind == 1:
        qty, price = rng.randint(1, 9), rng.randint(5, 400)
        text = (f"Order {rng.randint(1000, 99999)}: {name} from {city} bought {qty} x {rng.choice(_ITEMS)} "
                f"at {price} euros each, paid by {rng.choice(['card', 'cash', 'bank transfer'])}.")
        keys = ["order_id", "customer", "city", "item", "quantity", "unit_price", "payment"]
    else:
        text = (f"The {rng.choice(_EVENTS)} organised by {name} takes place in {city} on "
                f"{rng.choice(['March', 'May', 'July', 'October', 'December'])} {rng.randint(1, 28)} at "
                f"{rng.randint(8, 19)}:{rng.choice(['00', '15', '30', '45'])} with {rng.randint(4, 120)} guests.")
        keys = ["event", "organiser", "city", "date", "time", "guests"]
    style = rng.choice(["Extract the following fields as a JSON object with keys {k}: {t}",
                        "Return only JSON with the keys {k} for this text: {t}",
                        "Turn this into a JSON record ({k}): {t}",
                        "Parse the sentence below into JSON using the keys {k}.\n\n{t}"])
    return style.format(k=", ".join(keys), t=text)


class PromptStream:
    """An endless, seeded stream of user messages of one category."""

    def __init__(self, category: str, seed: int = 0) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; choose one of {', '.join(CATEGORIES)}")
        self.category = category
        self.rng = random.Random(f"{category}:{seed}")
        self._known: list[str] | None = None

    def next(self) -> str:
        if self.category == "sql":
            return _sql(self.rng)
        if self.category == "json":
            return _json(self.rng)
        if self._known is None:
            from training.prompts import load_prompts

            self._known = load_prompts("gsm8k", "train") + load_prompts("humaneval", "train")
        return self.rng.choice(self._known)


if __name__ == "__main__":
    for c in ("sql", "json"):
        s = PromptStream(c)
        for _ in range(3):
            print(f"[{c}] {s.next()}")
        print(f"[{c}] distinct prompts in 2000 draws: {len({s.next() for _ in range(2000)})}")
