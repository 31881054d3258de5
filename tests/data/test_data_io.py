"""Loading DeepScaleR-schema prompt files: jsonl, json, parquet; errors name the row."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_m2po.data import load_rows, write_jsonl

ROWS = [
    {"problem": "What is 1+1?", "answer": "2", "solution": "1+1=2"},
    {"problem": r"Find $\frac{1}{2}+\frac{1}{2}$.", "answer": "1"},
    {"problem": "AIME style", "answer": 204, "extra": "ignored"},
]


def test_jsonl_roundtrip_with_numeric_answer(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # trailing blank line is fine
    rows = load_rows(p)
    assert [r["problem"] for r in rows] == [r["problem"] for r in ROWS]
    assert [r["answer"] for r in rows] == ["2", "1", "204"]
    assert rows[0]["solution"] == "1+1=2" and "solution" not in rows[1]
    assert "extra" not in rows[2]


def test_parquet_matches_jsonl(tmp_path):
    table = pa.table({"problem": [r["problem"] for r in ROWS], "answer": ["2", "1", "204"],
                      "solution": ["1+1=2", None, None]})
    pq.write_table(table, tmp_path / "train.parquet")
    write_jsonl(ROWS, tmp_path / "train.jsonl")
    assert load_rows(tmp_path / "train.parquet") == load_rows(tmp_path / "train.jsonl")


def test_json_list(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    assert len(load_rows(tmp_path / "b.json")) == 3


def test_missing_field_names_row_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1 \(line 3\) lacks field\(s\) \['problem'\]"):
        load_rows(p)


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"question": ["q"], "answer": ["1"]}), tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['problem'\]"):
        load_rows(tmp_path / "q.parquet")


@pytest.mark.parametrize("row,msg", [
    ({"problem": "", "answer": "1"}, "'problem' must be a non-empty string"),
    ({"problem": "p", "answer": None}, r"lacks field\(s\) \['answer'\]"),
    ({"problem": "p", "answer": ["1"]}, "'answer' must be a non-empty string"),
    ({"problem": "p", "answer": True}, "'answer' must be a non-empty string"),
])
def test_bad_values_name_the_row(tmp_path, row, msg):
    p = write_jsonl([ROWS[0], row], tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match=f"row 1.*{msg}"):
        load_rows(p)


def test_file_level_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "a.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported format '.csv'"):
        load_rows(tmp_path / "a.csv")
    (tmp_path / "broken.jsonl").write_text('{"problem": "p", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_rows(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        load_rows(tmp_path / "empty.jsonl")
