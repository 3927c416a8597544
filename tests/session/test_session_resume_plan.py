"""Before first use, a Session says where it will resume (without building anything); an empty
checkpoint table keeps its columns."""

from __future__ import annotations

from helpers.models import tiny_config

import kit


def test_repr_and_html_before_first_use_say_where_training_resumes(tmp_path):
    prefix = str(tmp_path / "model")
    with kit.Session(**tiny_config(prefix)) as first:
        assert "epoch 1/3, step 0" in repr(first)  # nothing to resume: the plain position
        first.train_epoch()
        first.train_epoch()
    again = kit.Session(**tiny_config(prefix))
    assert repr(again) == "<kit.Session ready: will resume from model.002, epoch 3>"
    assert "will resume from model.002, epoch 3" in again._repr_html_()
    assert again.engine.model is None and not again.engine.is_set_up  # nothing was built or loaded
    again.setup()
    assert again.progress.epoch == 3  # and that is where it does resume
    assert "will resume" not in repr(again) and "epoch 3/3" in repr(again)
    again.train_steps(2)
    again.save()
    again.close()
    mid = kit.Session(**tiny_config(prefix))
    assert repr(mid) == "<kit.Session ready: will resume from model.003.step00000040, epoch 3, global step 40>"
    mid.close()
    fresh = kit.Session(**tiny_config(prefix, start_epoch=1))
    assert "will resume" not in repr(fresh)  # start_epoch=1 ignores the checkpoints


def test_a_finished_run_says_so_before_first_use(tmp_path):
    prefix = str(tmp_path / "model")
    with kit.Session(**tiny_config(prefix, num_epochs=1)) as s:
        s.train()
    done = kit.Session(**tiny_config(prefix, num_epochs=1))
    assert repr(done) == "<kit.Session ready: trained to epoch 1 (num_epochs=1), from model.001>"


def test_an_empty_checkpoint_table_keeps_its_columns(tmp_path):
    s = kit.Session(**tiny_config(str(tmp_path / "model")))
    table = s.checkpoints.table
    assert len(table) == 0
    assert list(table.columns)[:4] == ["name", "kind", "epoch", "global_train_step"] and "verified" in table.columns
