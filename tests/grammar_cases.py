"""Schemas and tools the structured-output checks share (tests, and scripts/gpu_grammar_check.py on the GPU,
where neither jsonschema nor the SDKs are installed)."""

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["pilot", "crane operator", "clerk"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "role"], "additionalProperties": False}

# Tools whose every string and number is bounded: random weights must end each call.
FORCED_TOOLS = [{"type": "function", "function": {"name": name, "parameters": params}} for name, params in (
    ("set_alarm", {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "label": {"type": "string", "maxLength": 6}}, "required": ["hour", "label"]}),
    ("move", {"type": "object", "properties": {
        "direction": {"enum": ["north", "south"]}, "steps": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["direction"]}),
    ("mute", {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}))]
FORCED_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
# PERSON with its name bounded too: random weights must end the answer.
BOUNDED_PERSON = {**PERSON, "properties": {**PERSON["properties"],
                                           "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"}}}
