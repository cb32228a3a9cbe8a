"""RACE reading comprehension (multiple choice)."""
