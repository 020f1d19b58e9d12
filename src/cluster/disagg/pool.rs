//! The prefill nodes a decode side may use: leases to the least-loaded healthy one, and their health checks.

use crate::cluster::handoff::HandoffReport;
use anyhow::{Result, bail};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One prefill node of a pool.
#[derive(Clone, Debug)]
pub struct PoolMember {
    /// Name in logs and `/metrics` (the cluster file's name, or the address).
    pub name: String,
    pub addr: String,
}

#[derive(Clone, Copy, Debug, Default)]
struct MemberState {
    up: bool,
    busy: usize,
    chosen: u64,
}

/// Called after every prefill that used a member (the server counts choices and bytes per peer with it).
pub type PoolObserver = Box<dyn Fn(&PoolMember, &HandoffReport) + Send + Sync>;

/// Prefill nodes shared by every decode slot of a process: per request the least-loaded healthy one is leased. With
/// a health loop running, a node whose prefill failed is taken out and put back when it accepts connections again;
/// without one (`baton run`), a failure only costs that request its offload.
pub struct PrefillPool {
    pub members: Vec<PoolMember>,
    state: Mutex<Vec<MemberState>>,
    checked: AtomicBool,
    observer: Option<PoolObserver>,
}

/// A prefill node in use by one request; dropping it frees the node's load count.
pub struct Lease {
    pool: Arc<PrefillPool>,
    pub index: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut st = self.pool.state.lock().unwrap_or_else(|p| p.into_inner());
        st[self.index].busy = st[self.index].busy.saturating_sub(1);
    }
}

/// The policy, a pure function: among healthy nodes the least busy; among those the one this decode slot used last
/// (its session there already holds the conversation), then the one chosen least often (spreads idle traffic).
pub fn choose_prefill(up_busy_chosen: &[(bool, usize, u64)], prefer: Option<usize>) -> Option<usize> {
    up_busy_chosen
        .iter()
        .enumerate()
        .filter(|(_, m)| m.0)
        .min_by_key(|&(i, m)| (m.1, Some(i) != prefer, m.2, i))
        .map(|(i, _)| i)
}

impl PrefillPool {
    pub fn new(members: Vec<PoolMember>, observer: Option<PoolObserver>) -> Arc<PrefillPool> {
        let state = vec![
            MemberState {
                up: true,
                ..Default::default()
            };
            members.len()
        ];
        Arc::new(PrefillPool {
            members,
            state: Mutex::new(state),
            checked: AtomicBool::new(false),
            observer,
        })
    }

    /// A pool from `--prefill-node HOST:PORT[,HOST:PORT...]`, each node named by its address.
    pub fn from_list(list: &str) -> Result<Arc<PrefillPool>> {
        let members: Vec<PoolMember> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| PoolMember {
                name: a.to_string(),
                addr: a.to_string(),
            })
            .collect();
        if members.is_empty() || members.iter().any(|m| !m.addr.contains(':')) {
            bail!("--prefill-node {list:?} must be HOST:PORT[,HOST:PORT...]");
        }
        Ok(PrefillPool::new(members, None))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<MemberState>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases the node for one request; `None` when every node is out.
    pub fn pick(self: &Arc<Self>, prefer: Option<usize>) -> Option<Lease> {
        let mut st = self.lock();
        let view: Vec<_> = st.iter().map(|m| (m.up, m.busy, m.chosen)).collect();
        let i = choose_prefill(&view, prefer)?;
        st[i].busy += 1;
        st[i].chosen += 1;
        Some(Lease {
            pool: self.clone(),
            index: i,
        })
    }

    pub fn is_up(&self, i: usize) -> bool {
        self.lock()[i].up
    }

    fn set_up(&self, i: usize, up: bool, why: &str) {
        let mut st = self.lock();
        if st[i].up != up {
            st[i].up = up;
            let (name, addr) = (&self.members[i].name, &self.members[i].addr);
            if up {
                tracing::info!("prefill node {name} ({addr}) is back up");
            } else {
                tracing::warn!("prefill node {name} ({addr}) is out: {why}");
            }
        }
    }

    /// What a prefill on member `i` did: a fallback takes the node out (when health checks can put it back).
    pub fn report(&self, i: usize, rep: &HandoffReport) {
        if let Some(why) = &rep.fallback
            && self.checked.load(Ordering::Relaxed)
        {
            self.set_up(i, false, why);
        }
        if let Some(f) = &self.observer {
            f(&self.members[i], rep);
        }
    }

    /// Checks every member once per `every` (a TCP connect within a second); ends when the pool is dropped.
    pub fn health_loop(self: &Arc<Self>, every: Duration) {
        self.checked.store(true, Ordering::Relaxed);
        let weak = Arc::downgrade(self);
        let targets = self.members.iter().map(|m| m.addr.clone()).enumerate().collect();
        let res = crate::cluster::health::spawn_loop("prefill-health", targets, every, move |i, r| {
            let Some(pool) = weak.upgrade() else { return false };
            match r {
                Ok(()) => pool.set_up(i, true, ""),
                Err(e) => pool.set_up(i, false, &format!("{e:#}")),
            }
            true
        });
        if let Err(e) = res {
            tracing::error!("cannot start the prefill pool's health checks: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_loaded_healthy_prefill_node_wins() {
        // (up, busy, chosen before)
        let v = [(true, 1, 0), (true, 0, 5), (true, 0, 2), (false, 0, 0)];
        assert_eq!(
            choose_prefill(&v, None),
            Some(2),
            "idle, chosen least often; the down node never"
        );
        assert_eq!(
            choose_prefill(&v, Some(1)),
            Some(1),
            "among the idle ones, the one holding the conversation"
        );
        assert_eq!(choose_prefill(&v, Some(0)), Some(2), "a busier preferred node loses");
        assert_eq!(choose_prefill(&[(false, 0, 0)], None), None);
    }

    #[test]
    fn pool_leases_spread_and_fallbacks_take_a_node_out() {
        let pool = PrefillPool::new(
            vec![
                PoolMember {
                    name: "p1".into(),
                    addr: "127.0.0.1:1".into(),
                },
                PoolMember {
                    name: "p2".into(),
                    addr: "127.0.0.1:2".into(),
                },
            ],
            None,
        );
        let a = pool.pick(None).unwrap();
        let b = pool.pick(None).unwrap();
        assert_ne!(
            a.index, b.index,
            "a busy node is not leased twice while another is idle"
        );
        drop((a, b));
        let failed = HandoffReport {
            fallback: Some("closed".into()),
            ..Default::default()
        };
        pool.report(0, &failed);
        assert!(
            pool.is_up(0),
            "without health checks nothing can put it back, so it stays in"
        );
        pool.checked.store(true, Ordering::Relaxed);
        pool.report(0, &failed);
        assert!(!pool.is_up(0));
        assert_eq!(pool.pick(Some(0)).unwrap().index, 1);
    }
}
