/*
 * Prints the size and field offsets of every rdma-core struct that
 * multirail-verbs mirrors in src/ffi.rs. Not part of the build: the crate
 * must compile without the header. Run it after an rdma-core ABI change and
 * compare with the assertions in src/ffi/layout.rs:
 *
 *   gcc -o /tmp/verbs_layout crates/verbs/layout/verbs_layout.c && /tmp/verbs_layout
 */
#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>

#define S(t) printf("size %s %zu\n", #t, sizeof(struct t))
#define U(t) printf("size %s %zu\n", #t, sizeof(union t))
#define O(t, f) printf("offset %s.%s %zu\n", #t, #f, offsetof(struct t, f))

int main(void)
{
	U(ibv_gid);

	S(ibv_device_attr);
	O(ibv_device_attr, node_guid);
	O(ibv_device_attr, max_mr_size);
	O(ibv_device_attr, vendor_id);
	O(ibv_device_attr, max_qp);
	O(ibv_device_attr, max_qp_wr);
	O(ibv_device_attr, max_sge);
	O(ibv_device_attr, max_cqe);
	O(ibv_device_attr, max_mr);
	O(ibv_device_attr, max_qp_rd_atom);
	O(ibv_device_attr, max_qp_init_rd_atom);
	O(ibv_device_attr, max_srq);
	O(ibv_device_attr, max_srq_wr);
	O(ibv_device_attr, max_srq_sge);
	O(ibv_device_attr, phys_port_cnt);

	S(ibv_port_attr);
	O(ibv_port_attr, state);
	O(ibv_port_attr, max_mtu);
	O(ibv_port_attr, active_mtu);
	O(ibv_port_attr, gid_tbl_len);
	O(ibv_port_attr, max_msg_sz);
	O(ibv_port_attr, lid);
	O(ibv_port_attr, active_width);
	O(ibv_port_attr, active_speed);
	O(ibv_port_attr, phys_state);
	O(ibv_port_attr, link_layer);
	O(ibv_port_attr, flags);
	O(ibv_port_attr, port_cap_flags2);

	S(ibv_context_ops);
	O(ibv_context_ops, poll_cq);
	O(ibv_context_ops, req_notify_cq);
	O(ibv_context_ops, post_srq_recv);
	O(ibv_context_ops, post_send);
	O(ibv_context_ops, post_recv);
	O(ibv_context_ops, _compat_async_event);

	O(ibv_context, device);
	O(ibv_context, ops);
	O(ibv_context, cmd_fd);
	O(ibv_context, async_fd);
	O(ibv_context, num_comp_vectors);

	O(ibv_pd, context);
	O(ibv_pd, handle);

	S(ibv_mr);
	O(ibv_mr, context);
	O(ibv_mr, pd);
	O(ibv_mr, addr);
	O(ibv_mr, length);
	O(ibv_mr, handle);
	O(ibv_mr, lkey);
	O(ibv_mr, rkey);

	O(ibv_cq, context);
	O(ibv_cq, channel);
	O(ibv_cq, cq_context);
	O(ibv_cq, handle);
	O(ibv_cq, cqe);

	O(ibv_comp_channel, context);
	O(ibv_comp_channel, fd);

	O(ibv_srq, context);
	O(ibv_srq, srq_context);
	O(ibv_srq, pd);
	O(ibv_srq, handle);

	O(ibv_qp, context);
	O(ibv_qp, qp_context);
	O(ibv_qp, pd);
	O(ibv_qp, send_cq);
	O(ibv_qp, recv_cq);
	O(ibv_qp, srq);
	O(ibv_qp, handle);
	O(ibv_qp, qp_num);
	O(ibv_qp, state);
	O(ibv_qp, qp_type);

	S(ibv_sge);
	O(ibv_sge, addr);
	O(ibv_sge, length);
	O(ibv_sge, lkey);

	S(ibv_send_wr);
	O(ibv_send_wr, wr_id);
	O(ibv_send_wr, next);
	O(ibv_send_wr, sg_list);
	O(ibv_send_wr, num_sge);
	O(ibv_send_wr, opcode);
	O(ibv_send_wr, send_flags);
	O(ibv_send_wr, imm_data);
	O(ibv_send_wr, wr);
	O(ibv_send_wr, wr.rdma.remote_addr);
	O(ibv_send_wr, wr.rdma.rkey);
	O(ibv_send_wr, wr.atomic.rkey);
	O(ibv_send_wr, qp_type);
	O(ibv_send_wr, bind_mw);
	O(ibv_send_wr, tso);

	S(ibv_recv_wr);
	O(ibv_recv_wr, wr_id);
	O(ibv_recv_wr, next);
	O(ibv_recv_wr, sg_list);
	O(ibv_recv_wr, num_sge);

	S(ibv_wc);
	O(ibv_wc, wr_id);
	O(ibv_wc, status);
	O(ibv_wc, opcode);
	O(ibv_wc, vendor_err);
	O(ibv_wc, byte_len);
	O(ibv_wc, imm_data);
	O(ibv_wc, qp_num);
	O(ibv_wc, src_qp);
	O(ibv_wc, wc_flags);
	O(ibv_wc, pkey_index);
	O(ibv_wc, slid);
	O(ibv_wc, sl);
	O(ibv_wc, dlid_path_bits);

	S(ibv_qp_cap);
	S(ibv_qp_init_attr);
	O(ibv_qp_init_attr, qp_context);
	O(ibv_qp_init_attr, send_cq);
	O(ibv_qp_init_attr, recv_cq);
	O(ibv_qp_init_attr, srq);
	O(ibv_qp_init_attr, cap);
	O(ibv_qp_init_attr, qp_type);
	O(ibv_qp_init_attr, sq_sig_all);

	S(ibv_srq_attr);
	S(ibv_srq_init_attr);
	O(ibv_srq_init_attr, srq_context);
	O(ibv_srq_init_attr, attr);

	S(ibv_global_route);
	O(ibv_global_route, dgid);
	O(ibv_global_route, flow_label);
	O(ibv_global_route, sgid_index);
	O(ibv_global_route, hop_limit);
	O(ibv_global_route, traffic_class);

	S(ibv_ah_attr);
	O(ibv_ah_attr, grh);
	O(ibv_ah_attr, dlid);
	O(ibv_ah_attr, sl);
	O(ibv_ah_attr, src_path_bits);
	O(ibv_ah_attr, static_rate);
	O(ibv_ah_attr, is_global);
	O(ibv_ah_attr, port_num);

	S(ibv_qp_attr);
	O(ibv_qp_attr, qp_state);
	O(ibv_qp_attr, cur_qp_state);
	O(ibv_qp_attr, path_mtu);
	O(ibv_qp_attr, path_mig_state);
	O(ibv_qp_attr, qkey);
	O(ibv_qp_attr, rq_psn);
	O(ibv_qp_attr, sq_psn);
	O(ibv_qp_attr, dest_qp_num);
	O(ibv_qp_attr, qp_access_flags);
	O(ibv_qp_attr, cap);
	O(ibv_qp_attr, ah_attr);
	O(ibv_qp_attr, alt_ah_attr);
	O(ibv_qp_attr, pkey_index);
	O(ibv_qp_attr, alt_pkey_index);
	O(ibv_qp_attr, en_sqd_async_notify);
	O(ibv_qp_attr, sq_draining);
	O(ibv_qp_attr, max_rd_atomic);
	O(ibv_qp_attr, max_dest_rd_atomic);
	O(ibv_qp_attr, min_rnr_timer);
	O(ibv_qp_attr, port_num);
	O(ibv_qp_attr, timeout);
	O(ibv_qp_attr, retry_cnt);
	O(ibv_qp_attr, rnr_retry);
	O(ibv_qp_attr, alt_port_num);
	O(ibv_qp_attr, alt_timeout);
	O(ibv_qp_attr, rate_limit);
	return 0;
}
