"""Small in-memory questions for grader and shuffle tests (no YAML involved)."""
from fsdp_lab.lessons.quiz.questions import LETTERS, Difficulty, Option, Question, QuestionType, Text


def make_question(answer: str, n_options: int = 4, qid: str = "q", multi: bool | None = None,
                  explanation: str = "{answer}") -> Question:
    multi = len(answer) > 1 if multi is None else multi
    options = tuple(Option(Text(f"选项{LETTERS[i]}", f"option {LETTERS[i]}"),
                           Text(f"反馈{LETTERS[i]}", f"feedback {LETTERS[i]}")) for i in range(n_options))
    return Question(id=qid, type=QuestionType.MULTI if multi else QuestionType.SINGLE, difficulty=Difficulty.MID,
                    prompt=Text("题", "question"), options=options,
                    answer=frozenset(LETTERS.index(c) for c in answer), explanation=Text(explanation, explanation),
                    tags=("test",))


def idx(letters: str) -> set[int]:
    """"AC" -> {0, 2}"""
    return {LETTERS.index(c) for c in letters}
