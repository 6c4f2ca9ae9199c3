"""The reasoning_gym tasks that may score model text, by name, for the vetted release
(why each is allowed or refused: dora_jax/rewards/reasoning_gym_scores.py). Here, at
the bottom, so that validating a config refuses a task without importing it."""

from __future__ import annotations

VETTED_VERSION = "0.1.25"

_EVAL = "its score_answer calls eval() on the response"
_SYMPY = "its score_answer parses the response with sympy's parse_expr, which runs eval()"
REFUSED: dict[str, str] = {
    "binary_matrix": _EVAL,
    "spiral_matrix": _EVAL,
    "n_queens": _EVAL,
    "string_insertion": _EVAL,
    "intermediate_integration": _SYMPY,
    "simple_integration": _SYMPY,
    "polynomial_multiplication": _SYMPY,
    "composite": "it mixes tasks, some of which evaluate the response; name one task",
    "game_of_life_halting": "its score_answer compares bool(answer) with bool(reference), so "
                            "every non-empty answer to a 'True' or 'False' question scores 1",
    "list_functions": "its questions are not reproducible from the seed, so scoring cannot "
                      "re-derive the entry a response answers",
}

# Scored by `arithmetic_score` (the response's expression, parsed by our own
# arithmetic-only parser) instead of the dataset's parse_expr-based score_answer.
OWN_PARSER = frozenset({"countdown", "puzzle24"})

ALLOWED = OWN_PARSER | frozenset("""
ab acre advanced_geometry aiw arc_1d arc_agi base_conversion basic_arithmetic bf
binary_alternation bitwise_arithmetic boxnet caesar_cipher calendar_arithmetic chain_sum
circuit_logic codeio coin_flip color_cube_rotation complex_arithmetic count_bits
count_primes course_schedule cryptarithm decimal_arithmetic decimal_chain_sum dice
emoji_mystery family_relationships figlet_font fraction_simplification futoshiki
game_of_life gcd graph_color group_anagrams gsm_symbolic
isomorphic_strings jugs kakurasu knight_swap knights_knaves largest_island lcm
leg_counting letter_counting letter_jumble mahjong_puzzle
manipulate_matrix maze mini_sudoku modulo_grid needle_haystack number_filtering
number_format number_sequence number_sorting palindrome_generation
palindrome_partitioning path_star polynomial_equations pool_matrix power_function
prime_factorization products propositional_logic quantum_lock ransom_note rearc
rectangle_count rotate_matrix rotten_oranges rubiks_cube rush_hour self_reference
sentence_reordering shortest_path simple_equations simple_geometry sokoban
spell_backward string_manipulation string_splitting string_synthesis sudoku survo
syllogism time_intervals tower_of_hanoi tsumego word_ladder word_sequence_reversal
word_sorting zebra_puzzles
""".split())


def refusal(task: str) -> str | None:
    """Why `task` may not score model text, or None if it may."""
    if task in ALLOWED:
        return None
    if task in REFUSED:
        return f"reasoning_gym task {task!r} is refused: {REFUSED[task]}"
    return (f"reasoning_gym task {task!r} is not one vetted for scoring untrusted text "
            f"(reasoning-gym {VETTED_VERSION}; see dora_jax/rewards/reasoning_gym_scores.py)")
