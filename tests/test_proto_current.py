"""The committed gRPC stubs match proto/tandem/v1/*.proto, and import as tandem.v1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.router import protogen


def test_committed_stubs_are_current():
    assert protogen.stale_files() == []
    assert protogen.main(["--check"]) == 0


def test_check_detects_an_edited_proto(tmp_path: Path):
    root = tmp_path / "proto"
    shutil.copytree(protogen.DEFAULT_PROTO_ROOT, root,
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = root / "tandem" / "v1" / "tandem.proto"
    source.write_text(source.read_text().replace(
        "message TopLogprob {", "message TopLogprob {\n  string text = 3;"))
    assert protogen.stale_files(root) == [
        "tandem/v1/tandem_pb2.py (differs)", "tandem/v1/tandem_pb2.pyi (differs)"]
    assert protogen.main(["--check", "--proto-root", str(root)]) == 1


def test_check_detects_missing_and_orphaned_stubs(tmp_path: Path):
    root = tmp_path / "proto"
    shutil.copytree(protogen.DEFAULT_PROTO_ROOT, root,
                    ignore=shutil.ignore_patterns("__pycache__"))
    pkg = root / "tandem" / "v1"
    (pkg / "tandem_pb2_grpc.py").unlink()
    (pkg / "old_pb2.py").write_text("# stub of a deleted .proto\n")
    assert protogen.stale_files(root) == [
        "tandem/v1/tandem_pb2_grpc.py (missing)", "tandem/v1/old_pb2.py (no .proto source)"]


def test_stubs_import_from_the_repository_package():
    from tandem.v1 import tandem_pb2, tandem_pb2_grpc

    # Another distribution's top-level `proto` module (proto-plus) must not be
    # what the stubs resolve to.
    assert Path(tandem_pb2.__file__).parent == protogen.DEFAULT_PROTO_ROOT / "tandem" / "v1"
    service = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    assert service.full_name == "tandem.v1.Tandem"
    assert [(m.name, m.server_streaming) for m in service.methods] == [
        ("Generate", True), ("GetModelInfo", False)]
    assert hasattr(tandem_pb2_grpc, "TandemStub")
    assert hasattr(tandem_pb2_grpc, "add_TandemServicer_to_server")


def test_request_round_trips_with_optional_presence():
    from tandem.v1 import tandem_pb2 as pb

    request = pb.GenerateRequest(
        request_id="r1", token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(temperature=0.0, stop=["\n"]), priority=-1, stream=True)
    parsed = pb.GenerateRequest.FromString(request.SerializeToString())
    assert parsed.WhichOneof("input") == "token_ids"
    assert list(parsed.token_ids.ids) == [1, 2, 3]
    # An explicit 0.0 temperature (greedy) is distinguishable from "unset".
    assert parsed.sampling.HasField("temperature")
    assert parsed.sampling.temperature == 0.0
    assert not parsed.sampling.HasField("top_p")
    assert (parsed.priority, parsed.stream) == (-1, True)


def test_finish_reason_values():
    from tandem.v1 import tandem_pb2 as pb

    assert {name: pb.FinishReason.Value(name) for name in pb.FinishReason.keys()} == {
        "FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2,
        "FINISH_REASON_ABORT": 3, "FINISH_REASON_ERROR": 4}


def test_check_fails_without_sources(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no .proto files"):
        protogen.main(["--check", "--proto-root", str(tmp_path)])
