//! The worker pods' identity: a ServiceAccount, and a RoleBinding of it to the
//! `kvfleet-worker` ClusterRole so that a pod may annotate itself with its measured capacity.

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};

use super::{worker_service_account_name, Owner};

/// ClusterRole (shipped in deploy/rbac) that lets a worker annotate its own pod.
pub const WORKER_CLUSTER_ROLE: &str = "kvfleet-worker";

pub(super) fn worker_service_account(owner: &Owner) -> ServiceAccount {
    ServiceAccount {
        metadata: owner.meta(worker_service_account_name(&owner.name)),
        automount_service_account_token: Some(true),
        ..ServiceAccount::default()
    }
}

pub(super) fn worker_role_binding(owner: &Owner) -> RoleBinding {
    RoleBinding {
        metadata: owner.meta(worker_service_account_name(&owner.name)),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: WORKER_CLUSTER_ROLE.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: worker_service_account_name(&owner.name),
            namespace: Some(owner.namespace.clone()),
            ..Subject::default()
        }]),
    }
}
