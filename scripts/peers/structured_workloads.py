"""The structured-output benchmark's schemas, prompts and measurement procedure (``scripts/bench_structured.py``).

Standard library only, so that our venv and the vLLM venv run the very same procedure on the very same
requests::

    sys.path.insert(0, "scripts/peers"); from structured_workloads import SCHEMAS, build_messages, run_suite

* :data:`SCHEMAS`: 20 JSON schemas of realistic extraction shapes (strings, integers, numbers, booleans, enums,
  arrays, nested objects, patterns, bounded strings and numbers, a nullable field, optional fields), each with
  a short text template whose slots are filled from fixed pools by a seeded ``random.Random``.
* :func:`build_messages`: case ``i`` is schema ``i % 20`` with its own text; the chat message asks the model to
  extract the text's data as JSON following the schema, which is quoted in the prompt (so free decoding has a
  fair chance). The driver renders the messages with *our* chat template to token ids, so both engines get the
  exact same prompt tokens.
* :func:`run_suite`: the measurements, given an engine's ``generate`` (see :class:`Gen`): request-level compile
  latency, conformance outputs (constrained and free), and the per-token cost of constrained against free
  decoding at each batch size. How each is measured is in the driver's docstring.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ---- the 20 schemas ------------------------------------------------------------------------------------


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}
_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _num(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _str(max_len: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_len}


def _arr(items: dict[str, Any], lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "array", "items": items}
    if lo is not None:
        out["minItems"] = lo
    if hi is not None:
        out["maxItems"] = hi
    return out


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    text: str  # a template: {slot} from POOLS (a random choice) or NUMBERS (a random value)


SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        "person",
        _obj(
            {"name": _S, "age": _int(0, 120), "city": _S, "occupation": _S, "email": _S},
            ["name", "age", "city", "occupation"],
        ),
        "{first} {last} is a {age}-year-old {job} living in {city}.",
    ),
    SchemaCase(
        "product_review",
        _obj(
            {
                "product": _S,
                "rating": _int(1, 5),
                "sentiment": _enum("positive", "negative", "neutral"),
                "pros": _arr(_str(40), 0, 3),
                "would_recommend": _B,
            }
        ),
        "Review of the {product}: {stars} stars. Battery life is great and it is light, but the price is high. "
        "I would buy it again.",
    ),
    SchemaCase(
        "product_listing",
        _obj(
            {
                "name": _S,
                "price": _num(0),
                "currency": _enum("USD", "EUR", "GBP"),
                "in_stock": _B,
                "tags": _arr(_S, 0, 5),
            }
        ),
        "The {product} by {company} sells for {price} EUR. Currently in stock. Tags: {tag}, {tag2}.",
    ),
    SchemaCase(
        "event",
        _obj(
            {
                "title": _S,
                "date": _DATE,
                "location": _obj({"city": _S, "venue": _S}),
                "expected_attendees": _int(0),
            }
        ),
        "The {topic} Summit takes place on 2025-{month}-{day} at the {venue} in {city}, "
        "with about {count} attendees expected.",
    ),
    SchemaCase(
        "contact",
        _obj(
            {
                "name": _S,
                "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
                "phone": _S,
                "company": _S,
            },
            ["name", "email", "company"],
        ),
        "Contact {first} {last} from {company} at {lower_first}.{lower_last}@example.com or +1 555 {phone}.",
    ),
    SchemaCase(
        "order",
        _obj(
            {
                "order_id": _S,
                "items": _arr(_obj({"sku": _S, "quantity": _int(1), "unit_price": _num(0)}), 1, 4),
                "total": _num(0),
                "paid": _B,
            }
        ),
        "Order A-{count} contains {qty} x SKU-{sku} at {price} each. Total {total}. Payment received.",
    ),
    SchemaCase(
        "movie",
        _obj(
            {
                "title": _S,
                "year": _int(1900, 2030),
                "genres": _arr(_enum("action", "comedy", "drama", "horror", "sci-fi", "romance"), 1, 3),
                "director": _S,
                "rating": _num(0, 10),
            }
        ),
        "{movie} ({year}), genre: {genre}, directed by {first} {last}. Critics rate it {score} out of 10.",
    ),
    SchemaCase(
        "job_posting",
        _obj(
            {
                "title": _S,
                "company": _S,
                "remote": _B,
                "salary": _obj({"min": _int(0), "max": _int(0)}),
                "seniority": _enum("junior", "mid", "senior"),
            }
        ),
        "{company} is hiring a senior {job}. Fully remote. Salary between {salary} and {salary2} dollars.",
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "name": _S,
                "servings": _int(1, 20),
                "ingredients": _arr(_obj({"item": _S, "amount": _S}), 1, 6),
                "vegetarian": _B,
            }
        ),
        "{dish} for {small} people: 200 g pasta, 2 tomatoes and 50 g cheese. No meat.",
    ),
    SchemaCase(
        "weather",
        _obj(
            {
                "city": _S,
                "temperature_c": _num(-60, 60),
                "condition": _enum("sunny", "cloudy", "rain", "snow", "storm"),
                "humidity_pct": _int(0, 100),
            }
        ),
        "In {city} today it is {temp} degrees Celsius and {weather}, with {pct}% humidity.",
    ),
    SchemaCase(
        "flight",
        _obj(
            {
                "airline": _S,
                "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "delayed": _B,
            }
        ),
        "{airline} flight {code}{flightno} from {iata} to {iata2} is delayed by {small}0 minutes.",
    ),
    SchemaCase(
        "book",
        _obj(
            {
                "title": _S,
                "author": _S,
                "pages": _int(1),
                "published_year": _int(1450, 2030),
                "genre": _enum("fiction", "non-fiction", "poetry", "biography", "science"),
            }
        ),
        "'{book}' by {first} {last}, published in {year}, is a {pages}-page work of fiction.",
    ),
    SchemaCase(
        "support_ticket",
        _obj(
            {
                "customer": _S,
                "category": _enum("billing", "technical", "account", "other"),
                "priority": _enum("low", "medium", "high"),
                "summary": _str(80),
                "needs_callback": _B,
            }
        ),
        "{first} {last} writes: I was charged twice for my subscription this month. Please call me back "
        "urgently.",
    ),
    SchemaCase(
        "invoice",
        _obj(
            {
                "invoice_number": _S,
                "vendor": _obj({"name": _S, "country": _S}),
                "amount": _num(0),
                "due_date": _DATE,
                "line_items": _arr(_obj({"description": _S, "amount": _num(0)}), 1, 5),
            }
        ),
        "Invoice INV-{count} from {company} ({country}) for {price} USD, due 2025-{month}-{day}: "
        "consulting services.",
    ),
    SchemaCase(
        "restaurant",
        _obj(
            {
                "name": _S,
                "cuisine": _S,
                "price_range": _enum("$", "$$", "$$$"),
                "rating": _num(1, 5),
                "address": _obj({"street": _S, "city": _S}),
            }
        ),
        "{last}'s is a mid-priced {cuisine} restaurant at {number} Main Street, {city}, rated {stars}.5 stars.",
    ),
    SchemaCase(
        "employee",
        _obj(
            {
                "name": _S,
                "department": _enum("engineering", "sales", "marketing", "finance", "hr"),
                "manager": {"type": ["string", "null"]},
                "start_year": _int(1970, 2030),
                "skills": _arr(_S, 1, 5),
            }
        ),
        "{first} {last} joined the engineering team in {year2} and reports to {first2} {last2}. "
        "Skills: Python, SQL.",
    ),
    SchemaCase(
        "medication",
        _obj(
            {
                "drug": _S,
                "dose_mg": _num(0),
                "times_per_day": _int(1, 6),
                "with_food": _B,
                "duration_days": _int(1, 365),
            },
            ["drug", "dose_mg", "times_per_day", "with_food"],
        ),
        "Take {drug} {dose} mg {small} times a day with meals for {count2} days.",
    ),
    SchemaCase(
        "real_estate",
        _obj(
            {
                "address": _S,
                "bedrooms": _int(0, 20),
                "bathrooms": _num(0, 20),
                "area_sqm": _num(0),
                "price": _int(0),
                "features": _arr(_str(30), 0, 5),
            }
        ),
        "For sale: {number} Oak Avenue, {city}. {small} bedrooms, 2 bathrooms, {area} square meters, "
        "garden and garage, asking {salary}0.",
    ),
    SchemaCase(
        "sports_match",
        _obj(
            {
                "home_team": _S,
                "away_team": _S,
                "home_score": _int(0),
                "away_score": _int(0),
                "winner": _enum("home", "away", "draw"),
            }
        ),
        "{city} FC beat the visiting {city2} United {goals} to 1 on Saturday.",
    ),
    SchemaCase(
        "bank_transaction",
        _obj(
            {
                "date": _DATE,
                "amount": _num(0),
                "direction": _enum("debit", "credit"),
                "merchant": _S,
                "category": _enum("groceries", "travel", "dining", "utilities", "other"),
            }
        ),
        "On 2025-{month}-{day} you paid {price} EUR at {company} Supermarket.",
    ),
]

POOLS: dict[str, list[str]] = {
    "first": ["Alice", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi"],
    "last": ["Moreau", "Silva", "Kowalski", "Nguyen", "Okafor", "Berg", "Tanaka", "Rossi", "Haddad"],
    "city": ["Lyon", "Porto", "Krakow", "Osaka", "Nairobi", "Denver", "Leeds", "Turin", "Austin"],
    "job": ["nurse", "data analyst", "carpenter", "teacher", "software engineer", "chef", "pilot"],
    "product": [
        "AeroBook 14 laptop",
        "Pulse X headphones",
        "TrailLite tent",
        "Brew Pro kettle",
        "Nova phone",
    ],
    "company": ["Acme", "Globex", "Initech", "Umbrella", "Stark", "Wayne", "Hooli", "Vandelay"],
    "tag": ["electronics", "outdoor", "kitchen", "audio", "travel"],
    "topic": ["Cloud", "Data", "Robotics", "Climate", "Fintech"],
    "venue": ["Grand Hall", "Expo Center", "Riverside Arena", "Palace Hotel"],
    "movie": ["Night Harbor", "The Last Orbit", "Paper Kings", "Silent Tide", "Glass Garden"],
    "genre": ["drama", "comedy", "sci-fi", "horror", "action"],
    "dish": ["Pasta al pomodoro", "Mac and cheese", "Baked ziti"],
    "weather": ["sunny", "cloudy", "rainy", "snowing"],
    "airline": ["Lufthansa", "Delta", "Air France", "KLM", "Iberia"],
    "code": ["LH", "DL", "AF", "KL", "IB"],
    "iata": ["FRA", "JFK", "CDG", "AMS", "MAD", "LHR", "SFO"],
    "book": ["The Quiet River", "Iron and Salt", "A Map of Stars", "Winter Letters"],
    "country": ["Germany", "France", "Spain", "Canada", "Japan"],
    "cuisine": ["Italian", "Thai", "Mexican", "Lebanese", "Japanese"],
    "drug": ["Amoxicillin", "Ibuprofen", "Metformin", "Lisinopril"],
}
POOLS["tag2"], POOLS["iata2"], POOLS["city2"] = POOLS["tag"], POOLS["iata"], POOLS["city"]
POOLS["first2"], POOLS["last2"] = POOLS["first"], POOLS["last"]

NUMBERS: dict[str, Callable[[random.Random], str]] = {
    "age": lambda r: str(r.randint(19, 79)),
    "stars": lambda r: str(r.randint(1, 5)),
    "price": lambda r: f"{r.randint(5, 1999)}.{r.randint(0, 99):02d}",
    "total": lambda r: f"{r.randint(20, 3999)}.{r.randint(0, 99):02d}",
    "month": lambda r: f"{r.randint(1, 12):02d}",
    "day": lambda r: f"{r.randint(1, 28):02d}",
    "count": lambda r: str(r.randint(100, 9999)),
    "count2": lambda r: str(r.randint(3, 30)),
    "phone": lambda r: f"{r.randint(1000, 9999)}",
    "qty": lambda r: str(r.randint(1, 9)),
    "sku": lambda r: str(r.randint(100, 999)),
    "year": lambda r: str(r.randint(1950, 2024)),
    "year2": lambda r: str(r.randint(2005, 2024)),
    "score": lambda r: f"{r.randint(3, 9)}.{r.randint(0, 9)}",
    "salary": lambda r: str(r.randint(40, 90) * 1000),
    "salary2": lambda r: str(r.randint(100, 180) * 1000),
    "small": lambda r: str(r.randint(2, 6)),
    "temp": lambda r: str(r.randint(-10, 35)),
    "pct": lambda r: str(r.randint(20, 95)),
    "flightno": lambda r: str(r.randint(10, 9999)),
    "pages": lambda r: str(r.randint(120, 900)),
    "number": lambda r: str(r.randint(1, 250)),
    "dose": lambda r: str(r.choice([250, 400, 500, 850, 1000])),
    "area": lambda r: str(r.randint(45, 300)),
    "goals": lambda r: str(r.randint(2, 5)),
}


def case_text(i: int, seed: int = 0) -> str:
    """The text of case ``i`` (schema ``i % len(SCHEMAS)``), its slots filled from its own random stream."""
    case = SCHEMAS[i % len(SCHEMAS)]
    rng = random.Random(f"inf-engine-bench-structured/{seed}/{i}")
    values: dict[str, str] = {}
    for key in sorted(POOLS):
        values[key] = rng.choice(POOLS[key])
    for key in sorted(NUMBERS):
        values[key] = NUMBERS[key](rng)
    values["lower_first"], values["lower_last"] = values["first"].lower(), values["last"].lower()
    return case.text.format(**values)


def build_messages(i: int, seed: int = 0) -> list[dict[str, str]]:
    """The chat of case ``i``: extract the text's data as JSON following the (quoted) schema."""
    schema = SCHEMAS[i % len(SCHEMAS)].schema
    content = (
        "Extract the information in the text as a JSON object that follows this JSON schema.\n"
        f"Schema: {json.dumps(schema, separators=(',', ':'))}\n"
        f"Text: {case_text(i, seed)}\n"
        "Answer with the JSON object only."
    )
    return [{"role": "user", "content": content}]


# A throwaway schema for the very first constrained request (it pays the one-time setup: xgrammar's tokenizer
# info, the compiler, the engine's grammar state), so the compile measurements start from a warm engine.
SETUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


# ---- the measurement procedure (run inside each engine's process) -------------------------------------


@dataclass
class Req:
    """One request of a batch: prompt token ids, ``max_tokens``, ``ignore_eos`` and an optional JSON schema
    (the constraint)."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    schema: dict[str, Any] | None = None


@dataclass
class Out:
    text: str
    num_tokens: int
    finish_reason: str | None


# generate(requests) -> (wall seconds of the engine's batched generate call, outputs in request order)
Gen = Callable[[list[Req]], tuple[float, list[Out]]]


def log(msg: str) -> None:
    print(f"[structured] {msg}", file=sys.stderr, flush=True)


def measure_request_compile(
    gen: Gen, short_prompt: list[int], schemas: list[dict[str, Any]]
) -> dict[str, Any]:
    """Request-level compile latency: for each schema (none seen before by the engine), the wall time of a
    1-token constrained request with it (first time: compile), then again (cached, the faster of two), minus
    the baseline: the same 1-token request without a constraint (median of 5 calls before the schemas and 5
    after). Reported in ms."""
    gen([Req(short_prompt, 1, schema=SETUP_SCHEMA)])  # one-time setup, not counted
    for _ in range(8):  # the first calls of a new shape are slow (allocator, kernels): not measured
        gen([Req(short_prompt, 1)])
    base = [gen([Req(short_prompt, 1)])[0] for _ in range(5)]
    first: list[float] = []
    cached: list[float] = []
    for schema in schemas:
        first.append(gen([Req(short_prompt, 1, schema=schema)])[0])
        cached.append(min(gen([Req(short_prompt, 1, schema=schema)])[0] for _ in range(2)))
    base += [gen([Req(short_prompt, 1)])[0] for _ in range(5)]
    b = statistics.median(base)
    return {
        "baseline_ms": [round(x * 1000, 3) for x in base],
        "first_ms": [round((x - b) * 1000, 3) for x in first],
        "cached_ms": [round((x - b) * 1000, 3) for x in cached],
    }


def run_suite(
    gen: Gen,
    cases: list[dict[str, Any]],
    short_prompt: list[int],
    batch_sizes: list[int],
    max_tokens: int,
    conformance_max_tokens: int,
    repeats: int,
    batch1_requests: int,
    cpu_seconds: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Everything that needs the engine, in order: request-level compile latency, conformance outputs, the
    per-token cost. ``cases``: ``[{"schema": index, "prompt_ids": [...]}, ...]``, at least max(batch_sizes)
    and 20 of them (the first 20 cover each schema once). The engine is expected to cache prefixes: each
    batch's prompts are run once untimed first, so that every timed run (constrained, free, prefill) finds
    the same prompts in the cache and pays the same (small) prefill. ``cpu_seconds``: the CPU time the engine's
    processes have used so far (recorded for each timed run: well under threads x wall = shared cores)."""
    schemas = [SCHEMAS[k].schema for k in range(len(SCHEMAS))]
    result: dict[str, Any] = {}

    log("warm-up")
    gen([Req(c["prompt_ids"], 8, ignore_eos=True) for c in cases[:4]])
    for c in cases[:4]:
        gen([Req(c["prompt_ids"], 4, ignore_eos=True)])

    log("request-level compile latency")
    result["request_compile"] = measure_request_compile(gen, short_prompt, schemas)

    log("conformance")
    conf = cases[: len(SCHEMAS)]
    t_c, outs_c = gen(
        [Req(c["prompt_ids"], conformance_max_tokens, schema=schemas[c["schema"]]) for c in conf]
    )
    t_f, outs_f = gen([Req(c["prompt_ids"], conformance_max_tokens) for c in conf])
    result["conformance"] = {
        "max_tokens": conformance_max_tokens,
        "constrained": [o.__dict__ for o in outs_c],
        "free": [o.__dict__ for o in outs_f],
        "constrained_s": round(t_c, 3),
        "free_s": round(t_f, 3),
    }

    per_token = []
    for bs in batch_sizes:
        # batch 1: `batch1_requests` single-request calls in a row (one call each), timed together
        groups = [[c] for c in cases[:batch1_requests]] if bs == 1 else [cases[:bs]]
        per_token.append(measure_batch(gen, bs, groups, schemas, max_tokens, repeats, cpu_seconds))
    result["per_token"] = per_token
    return result


def measure_batch(
    gen: Gen,
    bs: int,
    groups: list[list[dict[str, Any]]],
    schemas: list[dict[str, Any]],
    max_tokens: int,
    repeats: int,
    cpu_seconds: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Constrained, free (the same lengths) and prefill-only runs of one batch size, ``repeats`` times each."""

    def run_groups(make: Callable[[int, dict[str, Any]], Req]) -> tuple[float, list[Out]]:
        total, outs, j = 0.0, [], 0
        for group in groups:
            reqs = []
            for case in group:
                reqs.append(make(j, case))
                j += 1
            seconds, o = gen(reqs)
            total += seconds
            outs += o
        return total, outs

    def constrained() -> tuple[float, list[Out]]:
        return run_groups(lambda _j, c: Req(c["prompt_ids"], max_tokens, schema=schemas[c["schema"]]))

    def prefill() -> float:
        # the prompts alone (prefill + 1 token), subtracted from both for the decode-only figures
        return run_groups(lambda _j, c: Req(c["prompt_ids"], 1, ignore_eos=True))[0]

    log(f"batch {bs}: warming the prefix cache and the lengths")
    prefill()
    _, outs = constrained()
    lengths = [o.num_tokens for o in outs]
    finish = [o.finish_reason for o in outs]

    def free() -> float:
        # free decoding of exactly the constrained outputs' lengths (ignore_eos): the same tokens per
        # request, so the batch shrinks at the same steps and only the constraint differs
        seconds, outs_f = run_groups(lambda j, c: Req(c["prompt_ids"], lengths[j], ignore_eos=True))
        if [o.num_tokens for o in outs_f] != lengths:
            log(f"batch {bs}: free run made {sum(o.num_tokens for o in outs_f)} tokens, not {sum(lengths)}")
        return seconds

    runs: dict[str, list[float]] = {"constrained": [], "free": [], "prefill": []}
    cpu: dict[str, list[float]] = {"constrained": [], "free": [], "prefill": []}
    for r in range(repeats):
        log(f"batch {bs}: repeat {r + 1}/{repeats}")
        order = ["constrained", "free", "prefill"] if r % 2 == 0 else ["prefill", "free", "constrained"]
        for kind in order:
            cpu0 = cpu_seconds() if cpu_seconds is not None else 0.0
            if kind == "constrained":
                seconds, outs = constrained()
                if [o.num_tokens for o in outs] != lengths:
                    log(f"batch {bs}: constrained lengths changed ({sum(o.num_tokens for o in outs)})")
            else:
                seconds = free() if kind == "free" else prefill()
            runs[kind].append(seconds)
            if cpu_seconds is not None:
                cpu[kind].append(cpu_seconds() - cpu0)
    return {
        "batch_size": bs,
        "requests": sum(len(g) for g in groups),
        "calls": len(groups),
        "prompt_tokens": sum(len(c["prompt_ids"]) for g in groups for c in g),
        "output_tokens": sum(lengths),
        "lengths": lengths,
        "finish_reasons": finish,
        "seconds": {k: [round(x, 4) for x in v] for k, v in runs.items()},
        "cpu_seconds": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
        "loadavg_1m": round(_loadavg(), 2),
    }


def _loadavg() -> float:
    try:
        import os

        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
