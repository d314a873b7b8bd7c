"""ServiceAccount tokens verified by the real API server's TokenReview: the audience, a
deleted account, and the API server away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from rolegate_cli.controlplane import ControlPlane
from rolegate_proxy.core.access import Subject
from rolegate_proxy.edge.callers import KubeReviewer, ReviewUnavailable
from rolegate_proxy.edge.kube_api import KubeAccess, load_access

from ..waiting import eventually


def token(plane: ControlPlane, namespace: str, account: str, audience: str) -> str:
    out = plane.kubectl(
        "-n", namespace, "create", "token", account, "--audience", audience, "--duration", "1h"
    )  # fmt: skip
    return out.stdout.strip()


@pytest.fixture
async def reviewer(control_plane: ControlPlane) -> AsyncIterator[KubeReviewer]:
    async def access() -> KubeAccess:
        return await asyncio.to_thread(load_access, control_plane.kubeconfig)

    async with aiohttp.ClientSession() as session:
        yield KubeReviewer(session, access, timeout=3)


async def test_a_token_for_audience_rolegate_names_its_account(
    control_plane: ControlPlane, namespace: str, reviewer: KubeReviewer
) -> None:
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "coder")
    good = token(control_plane, namespace, "coder", "rolegate")
    assert await reviewer.review(good) == Subject.service_account(namespace, "coder")
    # The same account's token for another audience is no credential here.
    assert await reviewer.review(token(control_plane, namespace, "coder", "vault")) is None
    assert await reviewer.review("not.a.token") is None


async def test_a_deleted_account_s_token_is_refused(
    control_plane: ControlPlane, namespace: str, reviewer: KubeReviewer
) -> None:
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "gone")
    issued = token(control_plane, namespace, "gone", "rolegate")
    assert await reviewer.review(issued) is not None
    control_plane.kubectl("-n", namespace, "delete", "serviceaccount", "gone")

    async def refused() -> bool:
        # The API server's view of accounts follows the delete within moments.
        return await reviewer.review(issued) is None

    await eventually(refused, what="the deleted account's token refused", within=20, every=0.2)


async def test_the_api_server_away_is_not_a_verdict(
    control_plane: ControlPlane, namespace: str, reviewer: KubeReviewer
) -> None:
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "coder")
    issued = token(control_plane, namespace, "coder", "rolegate")
    await asyncio.to_thread(control_plane.stop_apiserver)
    try:
        with pytest.raises(ReviewUnavailable):
            await reviewer.review(issued)
    finally:
        await asyncio.to_thread(control_plane.start_apiserver)
