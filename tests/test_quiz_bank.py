"""The shipped question bank: schema-valid, enough questions per chapter, and chapter 10 is the article's
interview section, word for word (tests/quiz_fixtures/article_interview.txt is that section of the article)."""
import re
from pathlib import Path

import jsonschema
import pytest

from fsdp_lab.lessons.quiz import CHAPTERS, QuestionType, default_quiz_dir, load_bank, present
from fsdp_lab.lessons.quiz.bank import load_schema, read_yaml
from fsdp_lab.lessons.quiz.computed import HELPERS
from fsdp_lab.theory import formulas

FIXTURES = Path(__file__).parent / "quiz_fixtures"
ARTICLE = FIXTURES / "article_interview.txt"
SEED = Path(__file__).resolve().parents[2] / "shared" / "seed" / "000_3dd2debfca5a5036.txt"
ARTICLE_KEY = ["A", "B", "B", "C", "AB", "C", "AB", "A", "A", "AB"]


def parse_article(text: str) -> list[dict]:
    """The article's 面试题 section -> one dict per question."""
    questions = []
    for block in re.split(r"\n(?=Q\d+\. )", text)[1:]:
        lines = [line for line in block.splitlines() if line.strip()]
        number, prompt = re.match(r"Q(\d+)\. (.+)$", lines[0]).groups()
        kind, difficulty = re.match(r"(单选题|多选题) · (easy|mid|hard)$", lines[1]).groups()
        options, key = [], ""
        for line in lines[2:]:
            if m := re.match(r"\s*• ([A-D])\.(.+?)(← 正确答案)?$", line):
                options.append(m.group(2))
                key += m.group(1) if m.group(3) else ""
        explanation = next(line for line in lines if line.startswith("答案："))
        questions.append(dict(number=int(number), prompt=prompt, type="single" if kind == "单选题" else "multi",
                              difficulty=difficulty, options=options, key=key, explanation=explanation))
    return questions


@pytest.fixture(scope="module")
def bank():
    return load_bank()


@pytest.fixture(scope="module")
def article():
    return parse_article(ARTICLE.read_text(encoding="utf-8"))


def test_every_chapter_has_its_file():
    names = sorted(p.name for p in default_quiz_dir().glob("*.yaml"))
    assert names == sorted(f"{stem}.yaml" for stem in CHAPTERS.values())


@pytest.mark.parametrize("stem", list(CHAPTERS.values()))
def test_shipped_file_is_schema_valid(stem):
    path = default_quiz_dir() / f"{stem}.yaml"
    jsonschema.validate(read_yaml(path), load_schema())


def test_bank_loads_with_chapter_keys_in_order(bank):
    assert list(bank) == list(CHAPTERS)
    ids = [q.id for c in bank.values() for q in c.questions]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("key", [k for k in CHAPTERS if k != "10"])
def test_chapters_01_to_09_have_at_least_three_questions_with_feedback_everywhere(bank, key):
    questions = bank[key].questions
    assert len(questions) >= 3, (key, len(questions))
    assert {q.type for q in questions} == {QuestionType.SINGLE, QuestionType.MULTI}, key
    for q in questions:
        for opt in q.options:
            assert opt.feedback.zh.strip() and opt.feedback.en.strip(), q.id


def test_new_questions_do_not_all_answer_a(bank):
    keys = [q.answer_letters for k, c in bank.items() if k != "10" for q in c.questions]
    assert len({k[0] for k in keys}) >= 3, keys


def test_computed_numbers_name_real_formulas():
    used = set()
    for stem in CHAPTERS.values():
        for q in read_yaml(default_quiz_dir() / f"{stem}.yaml")["questions"]:
            used |= {spec["fn"] for spec in q.get("computed", {}).values()}
    assert used - set(HELPERS) <= {n for n in dir(formulas) if not n.startswith("_")}
    assert {"m_param", "m_zero1", "m_zero2", "m_zero3", "m_ddp", "m_fsdp", "m_peak", "n_min", "c_gather",
            "c_step", "c_ddp"} <= used


def test_a_shown_number_is_the_formula_value(bank):
    q = next(q for q in bank["05"].questions if q.id == "zero2-7b-8gpus")
    assert q.values["z2"] == f"{formulas.m_zero2(7e9, 8) / 1e9:g}" == "38.5"
    shown = present(q, "en")
    right = next(o for o in shown.options if o.correct)
    assert right.text == "38.5 GB"
    expected = [formulas.m_zero1(7e9, 8), formulas.m_zero2(7e9, 8), formulas.m_zero3(7e9, 8), formulas.m_ddp(7e9)]
    assert {o.text for o in shown.options} == {f"{v / 1e9:g} GB" for v in expected}


def test_article_answer_key(bank):
    assert [q.answer_letters for q in bank["10"].questions] == ARTICLE_KEY


def test_fixture_is_the_article_section():
    if not SEED.exists():
        pytest.skip(f"source article not present at {SEED}")
    assert ARTICLE.read_text(encoding="utf-8").strip() in SEED.read_text(encoding="utf-8")


def test_chapter_10_is_the_article_verbatim(bank, article):
    questions = bank["10"].questions
    assert len(article) == len(questions) == 10
    for q, a in zip(questions, article):
        shown = present(q, "zh")  # authoring order, no shuffle: the article's own letters
        assert q.source == f"article Q{a['number']}"
        assert shown.prompt == q.prompt.zh == a["prompt"]
        assert q.type.value == a["type"] and q.difficulty.value == a["difficulty"], q.id
        assert [o.text for o in shown.options] == a["options"], q.id
        assert q.answer_letters == a["key"], q.id
        assert shown.explanation == a["explanation"], q.id
        assert q.prompt.en and q.explanation.en.startswith("Answer: {answer}."), q.id


def test_claims_the_quizzes_teach_hold(bank):
    """Issue 20's corrections, tied to the numbers they quote: Q8's 1.5 is about elements at one dtype (the byte
    cases come from formulas), the cross-node option names the bandwidth gap and HYBRID_SHARD, and the sharding
    explanations say FSDP1 cuts a flat buffer while dim-0 splits are FSDP2's."""
    q8 = next(q for q in bank["10"].questions if q.id == "interview-q8")
    taught = q8.explanation.en + " ".join(o.feedback.en for o in q8.options)
    assert formulas.comm_bytes_ratio_fsdp_vs_ddp(8, param_bytes=2, reduce_bytes=2) == 0.75 and "0.75" in taught
    assert formulas.comm_bytes_ratio_fsdp_vs_ddp(8, param_bytes=2, reduce_bytes=4) == 1.0 and "about 1×" in taught
    assert formulas.comm_bytes_ratio_fsdp_vs_ddp(8, micro_batches=3) == 3.5 and "(2K+1)/2" in taught
    assert "cannot be less" not in taught and "in elements at one dtype" in taught
    jobs = next(q for q in bank["07"].questions if q.id == "use-which-jobs")
    nodes = next(o for o in jobs.options if "nodes" in o.text.en)
    assert "HYBRID_SHARD" in nodes.feedback.en and "HYBRID_SHARD" in nodes.feedback.zh
    assert "same way across nodes as within one, and" not in nodes.feedback.en
    unit = next(q for q in bank["02"].questions if q.id == "shard-unit")
    assert "FSDP2's layout" in unit.explanation.en and "FSDP1 flattens" in unit.explanation.en
    q1 = next(q for q in bank["10"].questions if q.id == "interview-q1")
    assert "FSDP2's layout" in q1.explanation.en and "FSDP2" in q1.options[0].feedback.zh


def test_chapter_keys_of_a_lettered_chapter():
    """06a (FSDP2) sits after 06; "6a", "fsdp2" and the file stem name it, and "6" still means 06."""
    from fsdp_lab.lessons.quiz.bank import chapter_key

    assert list(CHAPTERS)[5:7] == ["06", "06a"]  # the quizzes start at 01
    assert [chapter_key(t) for t in ("06a", "6a", "6A", "fsdp2", "06a-fsdp2")] == ["06a"] * 5
    assert [chapter_key(t) for t in ("6", "06", "engineering", "10", "1")] == ["06", "06", "06", "10", "01"]
    for bad in ("6z", "06z", "a6", "0"):
        with pytest.raises(ValueError, match="unknown chapter"):
            chapter_key(bad)
