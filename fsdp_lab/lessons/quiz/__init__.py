"""Self-graded quizzes: the article's ten interview questions (chapter 10) and more per chapter.

In a notebook:

    from fsdp_lab.lessons.quiz import quiz
    quiz("10", lang="zh")

In a terminal: `fsdp-lab quiz 10 --lang en`. The bank is `quizzes/*.yaml`, checked against `schema.json`;
scoring is `grader.grade` (multi-select: PrairieLearn's net-correct "PC" rule)."""
from fsdp_lab.lessons.quiz.bank import chapter_key, default_quiz_dir, load_bank, load_chapter, load_chapter_by_key
from fsdp_lab.lessons.quiz.scoring import PARTIAL_CREDIT_RULE, Grade, QuizRun, ShownQuestion, grade, present
from fsdp_lab.lessons.quiz.progress import ProgressStore
from fsdp_lab.lessons.quiz.questions import (CHAPTERS, AnswerFormatError, Chapter, Difficulty, Option,
                                             ProgressFileError, Question, QuestionType, QuizFileError, Text)


def quiz(chapter: str = "10", lang: str = "en", **kwargs):
    """The notebook quiz widget for `chapter` (see fsdp_lab.lessons.quiz.widget.quiz); imports ipywidgets lazily."""
    from fsdp_lab.lessons.quiz.widget import quiz as make

    return make(chapter, lang=lang, **kwargs)


__all__ = [
    "AnswerFormatError", "CHAPTERS", "Chapter", "Difficulty", "Grade", "Option", "PARTIAL_CREDIT_RULE",
    "ProgressFileError", "ProgressStore", "Question", "QuestionType", "QuizFileError", "QuizRun",
    "ShownQuestion", "Text", "chapter_key", "default_quiz_dir", "grade", "load_bank", "load_chapter",
    "load_chapter_by_key", "present", "quiz",
]
