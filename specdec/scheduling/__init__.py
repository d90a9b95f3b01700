"""A request and the schedules that run it: the request's types and the rules of its fields, the sequential and
PEARL round schedules, chained verifies, and adaptive overlap."""
